"""What a network sees (networks.py): its flat groups side by side and normalized, each image group
through a CNN encoder, the same network as rsl-rl-lib 5.5.1's `CNNModel` on the same weights and
inputs; ranks bitwise identical with images (symmetry's mirrored frames too), and networks without
images without encoders."""

import os

import pytest
import torch

import common
import envs
import networks
import ppo_ddp
from dist_helpers import chdir_rank_dir, free_port, run_ranks, small_args

B = 5


def image_obs() -> dict[str, torch.Tensor]:
    """A flat group, an image group of 2 x 12 x 10 and another flat group: the image's latent comes
    last."""
    torch.manual_seed(0)
    return {
        "policy": torch.randn(B, 3),
        "image": torch.rand(B, 2, 12, 10),
        "extra": torch.randn(B, 2),
    }


CONFIGS = {  # our arguments and rsl_rl's cnn_cfg for them
    "plain": ({}, {"output_channels": [16, 32], "kernel_size": 3, "stride": 2}),
    "every option": (
        {
            "cnn_channels": (8, 6),
            "cnn_kernel_size": (3, 2),
            "cnn_stride": (1, 2),
            "cnn_dilation": (2, 1),
            "cnn_norm": ("layer", "none"),
            "cnn_max_pool": (True, False),
            "cnn_padding": "replicate",
            "cnn_global_pool": "avg",
        },
        {
            "output_channels": [8, 6],
            "kernel_size": [3, 2],
            "stride": [1, 2],
            "dilation": [2, 1],
            "norm": ["layer", "none"],
            "max_pool": [True, False],
            "padding": "replicate",
            "global_pool": "avg",
        },
    ),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_actor_equals_rsl_rls_cnn_model_on_the_same_weights(config):
    """rsl_rl 5.5.1's CNNModel and our actor built from the same settings hold the same encoder
    layers (our `cnns` loads its `cnns` state dict as it is) and, given the same weights, the same
    mean to the last bit."""
    pytest.importorskip("rsl_rl", reason="rsl-rl-lib==5.5.1 is in requirements-dev.txt")
    from rsl_rl.models import CNNModel
    from tensordict import TensorDict

    ours_cfg, their_cfg = CONFIGS[config]
    obs = image_obs()
    groups = {"actor": ["policy", "image", "extra"], "critic": ["policy", "image", "extra"]}
    distribution = {"class_name": "GaussianDistribution", "init_std": 1.0, "std_type": "log"}
    theirs = CNNModel(
        TensorDict(obs, batch_size=[B]),
        groups,
        "actor",
        4,
        [32, 32],
        "elu",
        False,
        distribution,
        their_cfg,
    )
    args = small_args(
        ppo_ddp.Args,
        actor_obs=tuple(groups["actor"]),
        actor_hidden=(32, 32),
        normalize_obs=False,
        **ours_cfg,
    )
    actor, _ = ppo_ddp.make_networks(obs, 4, args)
    assert actor.inputs.cnns.state_dict().keys() == theirs.cnns.state_dict().keys()
    actor.inputs.cnns.load_state_dict(theirs.cnns.state_dict())
    with torch.no_grad():
        for mine, their in zip(actor.net.parameters(), theirs.mlp.parameters(), strict=True):
            mine.copy_(their)
    mean, _ = actor(obs)
    assert torch.equal(mean, theirs(TensorDict(obs, batch_size=[B])))


def test_flat_groups_side_by_side_then_each_images_latent_and_the_normalizer_sees_the_flat_part():
    obs = image_obs()
    shapes = envs.group_shapes(obs, ["policy", "image", "extra"])
    net_inputs = networks.Inputs(shapes, True, networks.settings(ppo_ddp.Args().cnn, shapes))
    flat = net_inputs.flat_part(obs)
    assert torch.equal(flat, torch.cat([obs["policy"], obs["extra"]], -1))
    # (T, N, width): the flat part
    common.update_normalizers([(net_inputs.normalizer, flat[None])], 1)
    assert torch.allclose(net_inputs.normalizer.mean, flat.double().mean(0))
    features = net_inputs(obs)
    latent = net_inputs.cnns["image"].latent
    assert features.shape == (B, 5 + latent) and net_inputs.width == 5 + latent
    assert torch.equal(features[:, :5], net_inputs.normalizer(flat))
    assert torch.equal(features[:, 5:], net_inputs.cnns["image"](obs["image"]))
    # (T, N, ...) groups
    lead = net_inputs({group: x[None].expand(3, *x.shape) for group, x in obs.items()})
    assert torch.equal(lead[1], features)


def test_networks_without_images_are_those_of_before():
    """No image group: no encoder, no state-dict key of one, and the MLP reads the normalized
    groups."""
    obs = {"policy": torch.randn(B, 3)}
    actor, critic = ppo_ddp.make_networks(obs, 1, ppo_ddp.Args())
    assert len(actor.inputs.cnns) == len(critic.inputs.cnns) == 0 and actor.config["cnn"] is None
    assert not any("cnns" in key for key in [*actor.state_dict(), *critic.state_dict()])
    assert actor.net[0].in_features == critic.net[0].in_features == 3


def _image_worker(root: str, ports: list[int]) -> list[str]:
    """2 iterations on pendulum_image, then the same with symmetry's mirrored frames in every
    mini-batch and its mirror loss -> the trained state's hash of each."""
    chdir_rank_dir(root)
    small = {
        "task": "pendulum_image",
        "num_envs": 8,
        "steps_per_env": 8,
        "iterations": 2,
        "logger": "none",
    }
    small |= {"run_dir": "a", "actor_obs": ("policy", "image"), "critic_obs": ("policy", "image")}
    symmetry = {
        "symmetry": "envs.mirrors:pendulum_image",
        "symmetry_augment": True,
        "symmetry_mirror_loss": 0.5,
    }
    hashes = []
    for overrides, port in zip(({}, {**symmetry, "run_dir": "b"}), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        hashes.append(ppo_ddp.main(small_args(ppo_ddp.Args, **{**small, **overrides})))
    return hashes


def test_two_ranks_with_images_stay_bitwise_identical(tmp_path):
    ranks = run_ranks(_image_worker, 2, str(tmp_path), [free_port(), free_port()])
    assert ranks[0] == ranks[1]
    assert ranks[0][0] != ranks[0][1]


def test_the_image_mirror_is_the_pendulum_mirrored():
    """The mirror function's frame of a pendulum is the frame of the mirrored pendulum (angle ->
    -angle)."""
    from envs import mirrors

    env = envs.make_env("pendulum_image", 6, "cpu", 0)
    obs = env.get_observations()
    mirrored, _ = mirrors.pendulum_image(env, {"image": obs["image"], "policy": obs["policy"]})
    env.theta, env.theta_dot = -env.theta, -env.theta_dot
    flipped = env.get_observations()
    torch.testing.assert_close(mirrored["image"][6:], flipped["image"], rtol=0, atol=1e-6)
    assert torch.equal(mirrored["policy"][6:], flipped["policy"])
