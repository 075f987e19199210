"""The Go1 training task `go1_trot` (envs/envpool.py `TrotGo1`): its trot reward on contact
sequences written by hand, the task's own reward scales and settings; and Go1's left-right mirror
(envs/mirrors.py `go1`) on the columns it moves. The mirror needs only torch; the task needs
EnvPool."""

import json
import os
import runpy
import sys

import numpy as np
import pytest
import torch

import arguments
import envs
import envs.envpool  # its tables and terms; EnvPool itself is imported where an env is made
import ppo_ddp
from dist_helpers import ROOT
from envs import mirrors

FR, FL, RR, RL = range(4)
GO1 = "Go1JoystickFlatTerrain-v1"


def test_go1_mirror_swaps_left_and_right_and_twice_is_the_identity():
    obs = {"state": torch.randn(3, 48), "privileged_state": torch.randn(3, 123)}
    actions = torch.randn(3, 12)
    both, both_actions = mirrors.go1(None, obs, actions)
    assert torch.equal(both["state"][:3], obs["state"]) and torch.equal(both_actions[:3], actions)
    image, image_actions = both["state"][3:], both_actions[3:]
    # the command (vx, vy, yaw) at 45:48 -> (vx, -vy, -yaw)
    assert torch.equal(image[:, 45:48], obs["state"][:, 45:48] * torch.tensor([1.0, -1.0, -1.0]))
    # linear velocity (x, y, z) -> (x, -y, z); gyro (x, y, z) -> (-x, y, -z)
    assert torch.equal(image[:, 0:3], obs["state"][:, 0:3] * torch.tensor([1.0, -1.0, 1.0]))
    assert torch.equal(image[:, 3:6], obs["state"][:, 3:6] * torch.tensor([-1.0, 1.0, -1.0]))
    # legs FR FL RR RL -> FL FR RL RR, the hip (first of each leg's three joints) negated
    legs = actions.view(3, 4, 3)[:, [FL, FR, RL, RR]] * torch.tensor([-1.0, 1.0, 1.0])
    assert torch.equal(image_actions, legs.reshape(3, 12))
    # foot contacts (privileged_state 99:103) swap left and right
    contacts = obs["privileged_state"][:, 99:103]
    assert torch.equal(both["privileged_state"][3:, 99:103], contacts[:, [FL, FR, RL, RR]])
    twice, twice_actions = mirrors.go1(None, {k: v[3:] for k, v in both.items()}, image_actions)
    assert all(torch.equal(twice[k][3:], obs[k]) for k in obs)
    assert torch.equal(twice_actions[3:], actions)
    with pytest.raises(ValueError, match="mirrors the groups"):
        mirrors.go1(None, {"policy": torch.zeros(1, 48)})


@pytest.fixture(scope="module")
def trot_env():
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    return envs.make_env("go1_trot", 1, "cpu", 0)


def trot_terms(env, contacts: list[tuple[int, ...]], command: float = 1.0) -> np.ndarray:
    """The trot term of each step of a contact sequence (the feet down at each step), fed to the
    env's `shape` with zero rewards, its timers started fresh; checks the reward it adds."""
    for timer in (env.down_s, env.up_s, env.last_down_s, env.last_up_s):
        timer[:] = 0.0
    terms = []
    for feet in contacts:
        privileged = np.zeros((1, 123), np.float32)
        privileged[0, 45] = command
        privileged[0, [99 + foot for foot in feet]] = 1.0
        rewards, added = env.shape({"privileged_state": privileged}, np.zeros(1, np.float32), {})
        np.testing.assert_array_equal(rewards, env.dt * added["reward_trot"])
        terms.append(added["reward_trot"][0])
    return np.array(terms)


def test_the_trot_reward_pays_a_diagonal_trot_and_not_a_held_pair_taps_or_standing(trot_env):
    weights = envs.envpool.TROT["go1_trot"]
    weight = weights["trot"]
    assert trot_env.dt == 0.02 and weights == {"trot": 0.5, "min_phase_s": 0.1}
    a, b = (FR, RL), (FL, RR)
    trot = ([a] * 10 + [b] * 10) * 4  # 0.2 s per phase
    terms = trot_terms(trot_env, trot)
    assert (terms[:20] == 0).all()  # no phase finished yet, or not every foot's
    assert (terms[20:] == weight).all()
    # one pair held down, the other up: paid only while each phase is shorter than 0.5 s
    held = trot_terms(trot_env, [a] * 10 + [b] * 10 + [a] * 50)
    assert (held[20:40] == weight).all() and (held[50:] == 0).all()
    # pairs swapped every step (0.02 s): paid 0.02 / 0.1 of the weight
    taps = trot_terms(trot_env, [a, b] * 20)
    np.testing.assert_allclose(taps[2:], weight * 0.2, rtol=1e-5)
    # all four down, or a trot while the command asks to stand still: nothing
    assert (trot_terms(trot_env, [(FR, FL, RR, RL)] * 40) == 0).all()
    assert (trot_terms(trot_env, trot, command=0.0) == 0).all()


def test_go1_trot_long_grades_the_trot_over_longer_phases():
    """`go1_trot_long` is `go1_trot` with the trot paid in full only after phases of 0.25 s: a
    trot of 0.2 s phases earns 0.8 of it."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    assert envs.envpool.NAMED["go1_trot_long"] == envs.envpool.NAMED["go1_trot"]
    weights = envs.envpool.TROT["go1_trot_long"]
    assert weights == {**envs.envpool.TROT["go1_trot"], "min_phase_s": 0.25}
    trot = ([(FR, RL)] * 10 + [(FL, RR)] * 10) * 3  # 0.2 s per phase
    terms = trot_terms(envs.make_env("go1_trot_long", 1, "cpu", 0), trot)
    np.testing.assert_allclose(terms[20:], weights["trot"] * 0.2 / 0.25, rtol=1e-5)


def test_go1_trot_is_the_envpool_id_with_its_scales_and_trains_with_symmetry(trot_env):
    config = trot_env.env.spec.config
    scales = (config.feet_air_time_scale, config.tracking_lin_vel_scale, config.feet_slip_scale)
    assert scales == (1.0, 1.5, -0.5) and config.pose_scale == 0.5  # the rest: the id's own
    _, rewards, _, extras = trot_env.step(torch.zeros(1, 12))
    assert "reward_trot" in extras["log"] and "reward_tracking_lin_vel" in extras["log"]
    args = arguments.parse_args(ppo_ddp.Args, envs.task_defaults, ["--task", "go1_trot"])
    assert args.mirror.symmetry == "envs.mirrors:go1" and args.mirror.symmetry_augment
    assert (args.num_envs, args.init_noise_std, args.entropy_coef) == (128, 0.5, 0.003)


def test_the_later_phases_raise_the_feet_terms_and_charge_feet_that_move_on_the_ground():
    """`go1_trot_lift`, `_high` and `_still` keep `go1_trot`'s scales and raise the feet's
    clearance and height terms; `_still` adds the stance-speed term: minus the sum, over the feet
    that are down, of the root of their horizontal speed (foot velocities at privileged_state
    103:115)."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    trot = envs.envpool.NAMED["go1_trot"][1]
    for task, clearance in [("go1_trot_lift", -6.0), ("go1_trot_high", -10.0)]:
        assert envs.envpool.NAMED[task][1] | trot == envs.envpool.NAMED[task][1]
        assert envs.envpool.NAMED[task][1]["feet_clearance_scale"] == clearance
    env = envs.make_env("go1_trot_still", 1, "cpu", 0)
    assert env.env.spec.config.action_rate_scale == -0.03
    privileged = np.zeros((1, 123), np.float32)
    privileged[0, [99 + FR, 99 + RL]] = 1.0  # FR and RL down
    velocities = privileged[0, 103:115].reshape(4, 3)
    velocities[FR] = (0.03, 0.04, 9.0)  # 0.05 m/s across the ground (its z is left out)
    velocities[RL] = (0.0, 0.16, 0.0)
    velocities[FL] = (3.0, 4.0, 0.0)  # up: not charged
    _, added = env.shape({"privileged_state": privileged}, np.zeros(1, np.float32), {})
    expected = -1.0 * (np.sqrt(0.05) + np.sqrt(0.16))
    np.testing.assert_allclose(added["reward_stance_speed"], [expected], rtol=1e-5)
    assert envs.envpool.TROT["go1_trot_still"]["stance_speed"] == 1.0
    assert "stance_speed" not in envs.envpool.TROT["go1_trot"]


def test_foot_heights_come_from_the_joint_angles_and_gravity():
    """`go1_foot_heights` (for `go1_trot_swing`'s swing-height term): in the default pose and
    level, every foot is at its sphere's radius; bending one leg's knee lifts that foot alone; a
    body pitched nose-up (gravity tilted in the body frame) puts the hind feet lowest."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    heights = envs.envpool.go1_foot_heights
    level = np.array([[0.0, 0.0, -1.0]], np.float32)
    home = heights(np.zeros((1, 12), np.float32), level)
    np.testing.assert_allclose(home, 0.023, atol=1e-6)
    bent = np.zeros((1, 12), np.float32)
    bent[0, 3 * FL + 2] = -0.6  # FL's knee folds further
    lifted = heights(bent, level)[0]
    assert lifted[FL] > 0.05 and np.allclose(lifted[[FR, RR, RL]], 0.023, atol=1e-6)
    nose_up = np.array([[-np.sin(0.2), 0.0, -np.cos(0.2)]], np.float32)  # pitched 0.2 rad
    pitched = heights(np.zeros((1, 12), np.float32), nose_up)[0]
    assert pitched[[FR, FL]].min() > pitched[[RR, RL]].max() + 0.05
    # the same as MuJoCo's own kinematics of the model, for any pose and tilt
    import mujoco

    model, data, default, feet = envs.envpool.go1_model()
    rng = np.random.default_rng(0)
    offsets = rng.normal(0.0, 0.4, (20, 12)).astype(np.float32)
    gravity = (rng.normal(0.0, 0.3, (20, 3)) - (0.0, 0.0, 1.0)).astype(np.float32)
    relative = np.zeros((20, 4, 3))
    for env, offset in enumerate(offsets):
        data.qpos[:] = default
        data.qpos[:7] = (0, 0, 0, 1, 0, 0, 0)  # the body at the origin, unrotated
        data.qpos[7:19] = default[7:19] + offset
        mujoco.mj_kinematics(model, data)
        relative[env] = data.site_xpos[feet]
    up = -gravity / np.linalg.norm(gravity, axis=1, keepdims=True)
    height = (relative * up[:, None, :]).sum(axis=-1)
    expected = 0.023 + height - height.min(axis=1, keepdims=True)
    np.testing.assert_allclose(heights(offsets, gravity), expected, atol=1e-6)


def low_feet_state() -> np.ndarray:
    """`privileged_state` of two level envs with FR down and rolling at 0.1 m/s, FL in the air at
    0.059 m sweeping at 0.5 m/s, RL up at 0.140 m; the body at 1 m/s in the first env, at 0.1 m/s
    in the second."""
    privileged = np.zeros((2, 123), np.float32)
    privileged[:, 54:57] = (0.0, 0.0, -1.0)  # level
    privileged[:, 99 + FR] = 1.0  # FR down (at 0.023 m) and rolling: not charged
    privileged[:, 63 + 3 * FL + 2] = -0.2  # FL's knee folded: 0.059 m up, in the air
    privileged[:, 63 + 3 * RL + 2] = -0.6  # RL's: 0.140 m up, above 0.07 m: not charged
    velocities = privileged[:, 103:115].reshape(2, 4, 3)
    velocities[:, FR] = (0.1, 0.0, 0.0)
    velocities[:, FL] = (0.3, 0.4, 5.0)  # 0.5 m/s across the ground (its z is left out)
    velocities[:, RL] = (2.0, 0.0, 0.0)
    privileged[0, 57:60] = (1.0, 0.0, 0.3)  # the body at 1 m/s
    privileged[1, 57:60] = (0.1, 0.0, 0.0)  # at 0.1 m/s
    return privileged


def test_the_landing_phase_charges_fast_feet_near_the_ground_and_drops_the_clip():
    """`go1_trot_land` adds the low-feet term: minus the horizontal speed of the feet that are off
    the ground, or lifting (above 0.035 m), and below 0.07 m, over the body's horizontal speed
    (privileged_state 57:59, at least 0.25 m/s); and sums Playground's terms again without its
    clip at 0, so that every step's penalties count."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    env = envs.make_env("go1_trot_land", 2, "cpu", 0)
    weight = envs.envpool.TROT["go1_trot_land"]["low_feet"]
    privileged = low_feet_state()  # the second env's body at 0.1 m/s: divided by 0.25
    _, added = env.shape({"privileged_state": privileged}, np.zeros(2, np.float32), {})
    np.testing.assert_allclose(added["reward_low_feet"], [-weight * 0.5, -weight * 2.0], rtol=1e-5)
    privileged[:, 99 + FL] = 1.0  # FL down but 0.059 m up: lifting, still charged
    _, added = env.shape({"privileged_state": privileged}, np.zeros(2, np.float32), {})
    np.testing.assert_allclose(added["reward_low_feet"], [-weight * 0.5, -weight * 2.0], rtol=1e-5)
    # the reward: Playground's terms and the added ones, times the control step, not clipped at 0
    torch.manual_seed(0)
    negative = False
    for _ in range(20):
        _, rewards, _, extras = env.step(torch.randn(2, 12))
        total = sum(extras["log"].values())
        torch.testing.assert_close(rewards, env.dt * total)
        negative |= bool((rewards < 0).any())
    assert negative


def test_the_flying_phase_charges_each_foot_down_while_the_command_asks_to_move():
    """`go1_trot_fly` keeps `go1_trot_land`'s scales and terms and adds minus the number of feet
    down (contacts at privileged_state 99:103) while the command (45:48) asks to move;
    `go1_trot_clear` raises its clearance scale, `go1_trot_stride` its air-time scale too;
    `go1_trot_all` keeps Playground's clip."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    env = envs.make_env("go1_trot_fly", 3, "cpu", 0)
    assert envs.envpool.NAMED["go1_trot_fly"] == envs.envpool.NAMED["go1_trot_land"]
    # `go1_trot_clear`: the same terms, the clearance scale raised from -10 to -15
    clear = envs.envpool.NAMED["go1_trot_clear"]
    assert clear == (GO1, {**envs.envpool.NAMED["go1_trot_fly"][1], "feet_clearance_scale": -15.0})
    assert envs.envpool.TROT["go1_trot_clear"] == envs.envpool.TROT["go1_trot_fly"]
    # `go1_trot_stride`: `go1_trot_clear` with the air-time scale raised from 3 to 6
    stride = envs.envpool.NAMED["go1_trot_stride"]
    assert stride == (GO1, {**clear[1], "feet_air_time_scale": 6.0})
    assert envs.envpool.TROT["go1_trot_stride"] == envs.envpool.TROT["go1_trot_fly"]
    # `go1_trot_all`, for a fresh start: `go1_trot_fly`'s scales and terms with Playground's clip
    assert envs.envpool.NAMED["go1_trot_all"] == envs.envpool.NAMED["go1_trot_fly"]
    fly = envs.envpool.TROT["go1_trot_fly"]
    assert envs.envpool.TROT["go1_trot_all"] == {k: v for k, v in fly.items() if k != "unclipped"}
    weights = envs.envpool.TROT["go1_trot_fly"]
    assert {k: v for k, v in weights.items() if k != "feet_down"} == envs.envpool.TROT[
        "go1_trot_land"
    ]
    privileged = np.zeros((3, 123), np.float32)
    privileged[:, 54:57] = (0.0, 0.0, -1.0)  # level
    privileged[:, 45] = (1.0, 1.0, 0.05)  # the third env's command is to stand
    privileged[0, [99 + FR, 99 + RL]] = 1.0  # a diagonal pair down
    privileged[1:, 99:103] = 1.0  # all four down
    _, added = env.shape({"privileged_state": privileged}, np.zeros(3, np.float32), {})
    expected = [-2 * weights["feet_down"], -4 * weights["feet_down"], 0.0]
    np.testing.assert_allclose(added["reward_feet_down"], expected, rtol=1e-6)


def test_the_touch_and_roll_phases_charge_landing_and_rolling_feet_per_body_speed():
    """`go1_trot_touch` keeps `go1_trot_clear`'s scales and terms and adds minus Playground's
    clearance cost (|height - 0.1 m| times the root of the horizontal speed) of the feet the
    low-feet term charges, over the root of the body's horizontal speed (at least 0.25 m/s);
    `go1_trot_roll` charges the feet on the ground per unit of the body's speed."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    env = envs.make_env("go1_trot_touch", 2, "cpu", 0)
    assert envs.envpool.NAMED["go1_trot_touch"] == envs.envpool.NAMED["go1_trot_clear"]
    weights = envs.envpool.TROT["go1_trot_touch"]
    assert {k: v for k, v in weights.items() if k != "low_clearance"} == envs.envpool.TROT[
        "go1_trot_clear"
    ]
    privileged = low_feet_state()  # the second env's body at 0.1 m/s: by the root of 0.25
    height = envs.envpool.go1_foot_heights(privileged[:1, 63:75], privileged[:1, 54:57])[0, FL]
    assert 0.055 < height < 0.065
    _, added = env.shape({"privileged_state": privileged}, np.zeros(2, np.float32), {})
    cost = (0.1 - height) * np.sqrt(0.5)
    expected = [-weights["low_clearance"] * cost, -weights["low_clearance"] * cost / 0.5]
    np.testing.assert_allclose(added["reward_low_clearance"], expected, rtol=1e-5)
    assert "reward_low_feet" in added  # the low-feet term stays
    # `go1_trot_roll` adds minus the root of each foot-down's speed over the body's (at least
    # 0.25 m/s), while the command asks to move; the air-time scale as `go1_trot_stride`'s
    assert envs.envpool.NAMED["go1_trot_roll"] == envs.envpool.NAMED["go1_trot_stride"]
    roll = envs.envpool.TROT["go1_trot_roll"]
    assert roll == {**weights, "stance_roll": roll["stance_roll"]}
    privileged[0, 45], privileged[1, 45] = 1.0, 0.05  # the second env's command is to stand
    _, added = envs.make_env("go1_trot_roll", 2, "cpu", 0).shape(
        {"privileged_state": privileged}, np.zeros(2, np.float32), {}
    )
    expected = [-roll["stance_roll"] * np.sqrt(0.1 / 1.0), 0.0]  # FR at 0.1 m/s is down
    np.testing.assert_allclose(added["reward_stance_roll"], expected, rtol=1e-5)


def test_the_clearance_benchmark_follows_a_swing_step_by_step():
    """benchmarks/go1_clearance.py's `swing_profile` on a hand-written swing: FL up from step 3 to
    step 9, its height rising 0.01 m a step, every foot at 0.25 m/s."""
    module = runpy.run_path(os.path.join(ROOT, "benchmarks", "go1_clearance.py"))
    down = np.ones((12, 1, 4), bool)
    down[3:10, 0, FL] = False
    heights = np.full((12, 1, 4), 0.023)
    heights[:, 0, FL] = np.arange(12) / 100
    speed = np.full((12, 1, 4), 0.25)
    rows = dict(module["swing_profile"](down, heights, speed))
    assert list(rows) == ["-1", "0", "1", "2", "end-3", "end-2", "end-1", "end-0", "+1"]
    expected = {"-1": 0.02, "0": 0.03, "2": 0.05, "end-3": 0.06, "end-0": 0.09, "+1": 0.10}
    for name, height in expected.items():
        np.testing.assert_allclose(rows[name], [height, 0.25, abs(height - 0.1) * 0.5])
    short = down.copy()
    short[3:8, 0, FL], short[8:, 0, FL] = False, True  # a swing of 5 steps: too short to follow
    assert module["swing_profile"](short, heights, speed) == []
    # FL down for 3 steps, up for 7, down for 4, up again: the first and last phases unfinished
    feet = np.ones((16, 1, 4), bool)
    feet[3:10, 0, FL] = feet[14:, 0, FL] = False
    assert module["phase_lengths"](feet) == (7.0, 4.0)


def test_the_gait_clock_mirrors_to_the_other_pair_and_pays_the_phase_it_asks_for():
    """`go1_clock` (`ClockGo1`): the `clock` group is `gait_clock` of the steps since the episode
    began, and the mirror moves it half a period on (the diagonal pairs swap); the phase terms pay
    the share of feet down or up as the clock asks (all down while the command is to stand) and
    the swinging feet's nearness to `swing_reference`."""
    steps = torch.arange(60.0)
    period = envs.envpool.CLOCK["go1_clock"]["period_steps"]
    clock = envs.envpool.gait_clock(steps, period)
    both, _ = mirrors.go1(None, {"clock": clock})
    torch.testing.assert_close(
        both["clock"][60:], envs.envpool.gait_clock(steps + period / 2, period)
    )
    reference = envs.envpool.swing_reference(np.array([0.0, 0.25, 0.5, 0.75, 1.0]))
    np.testing.assert_allclose(reference, [0.023, 0.1, 0.1, 0.1, 0.023], rtol=1e-6)
    steep = envs.envpool.swing_reference(np.array([0.0, 0.0625, 0.125, 0.5, 0.875, 1.0]), 0.125)
    np.testing.assert_allclose(steep, [0.023, 0.0615, 0.1, 0.1, 0.1, 0.023], rtol=1e-6)
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    env = envs.make_env("go1_clock", 3, "cpu", 0)
    weights = envs.envpool.CLOCK["go1_clock"]
    named, clock = envs.envpool.NAMED, envs.envpool.CLOCK
    for task, scales in [("go1_clock", "go1_trot"), ("go1_clock_high", "go1_trot_high")]:
        assert named[task] == named[scales]
    assert named["go1_clock_still"] == named["go1_trot_land"] and clock["go1_clock_high"] == weights
    assert named["go1_clock_final"] == named["go1_clock_clear"] == named["go1_trot_clear"]
    # the later phases: the first line's stance and landing terms, its swing-height term left out
    assert {**clock["go1_clock_still"], "swing_height": 10.0, "phase_height": 0.5} == {
        **weights,
        **envs.envpool.TROT["go1_trot_low"],
        "trot": 0.0,
    }
    assert clock["go1_clock_clear"] == {
        **clock["go1_clock_still"],
        "feet_down": 0.5,
        "period_steps": 32.0,
    }
    assert clock["go1_clock_final"] == {**clock["go1_clock_clear"], "period_steps": 28.0}
    args = arguments.parse_args(ppo_ddp.Args, envs.task_defaults, ["--task", "go1_clock"])
    assert args.actor_obs == ("state", "clock") and args.critic_obs[1] == "clock"
    torch.testing.assert_close(
        env.get_observations()["clock"], envs.envpool.gait_clock(steps[:3] * 0, period)
    )
    for _ in range(4):
        obs, _, dones, _ = env.step(torch.zeros(3, 12))
    assert not dones.any()
    torch.testing.assert_close(obs["clock"], envs.envpool.gait_clock(torch.full((3,), 4.0), period))
    # the step this reward judges ends at clock step 1 (FR and RL asked up): the first env has FR
    # and RL up, the second all four down, the third is asked to stand and has all four down
    env.clock_steps[:] = 0.0
    privileged = np.zeros((3, 123), np.float32)
    privileged[:, 54:57] = (0.0, 0.0, -1.0)  # level, in the default pose: every foot 0.023 m up
    privileged[:, 45] = (1.0, 1.0, 0.05)
    privileged[0, [99 + FL, 99 + RR]] = 1.0
    privileged[1:, 99:103] = 1.0
    _, added = env.shape({"privileged_state": privileged}, np.zeros(3, np.float32), {})
    expected = [weights["phase_contact"], weights["phase_contact"] / 2, weights["phase_contact"]]
    np.testing.assert_allclose(added["reward_phase_contact"], expected, rtol=1e-6)
    wanted = envs.envpool.swing_reference(np.array([2.0 / period]))[0]
    near = np.exp(-(((0.023 - wanted) / env.HEIGHT_M) ** 2))
    np.testing.assert_allclose(
        added["reward_phase_height"], [weights["phase_height"] * near] * 2 + [0.0], rtol=1e-4
    )
    # `go1_clock_fly` asks each foot down for 40 % of the period: at clock step 1 FR and RL have
    # just left the ground and FL and RR are still in the air, all four asked up
    assert clock["go1_clock_fly"] == {**clock["go1_clock_final"], "duty": 0.4}
    assert named["go1_clock_fly"] == named["go1_clock_final"]
    assert (
        named["go1_clock_press"]
        == (
            named["go1_clock_final"][0],
            {**named["go1_clock_final"][1], "feet_clearance_scale": -30.0},
        )
        and clock["go1_clock_press"] == clock["go1_clock_final"]
    )
    assert named["go1_clock_steep"] == named["go1_clock_press"]
    assert clock["go1_clock_steep"] == {**clock["go1_clock_final"], "ramp": 0.125}
    # steeper ramps: the foot one step into its swing is asked higher, and paid for its nearness
    env.weights = {**weights, "ramp": 0.125}
    env.clock_steps[:] = 0.0
    _, added = env.shape({"privileged_state": privileged}, np.zeros(3, np.float32), {})
    steep = envs.envpool.swing_reference(np.array([2.0 / period]), 0.125)[0]
    assert steep > wanted + 0.01
    near = np.exp(-(((0.023 - steep) / env.HEIGHT_M) ** 2))
    np.testing.assert_allclose(
        added["reward_phase_height"], [weights["phase_height"] * near] * 2 + [0.0], rtol=1e-4
    )
    env.weights = {**weights, "duty": 0.4}
    env.clock_steps[:] = 0.0
    _, added = env.shape({"privileged_state": privileged}, np.zeros(3, np.float32), {})
    expected = [weights["phase_contact"] / 2, 0.0, weights["phase_contact"]]
    np.testing.assert_allclose(added["reward_phase_contact"], expected, rtol=1e-6)
    progress = np.array([1.0, 1.0 - period / 2, 1.0 - period / 2, 1.0]) / period % 1.0 / 0.6
    near = np.exp(-(((0.023 - envs.envpool.swing_reference(progress)) / env.HEIGHT_M) ** 2))
    np.testing.assert_allclose(
        added["reward_phase_height"], [weights["phase_height"] * near.mean()] * 2 + [0.0], rtol=1e-4
    )


def test_a_cadence_turns_the_clock_with_the_commanded_speed():
    """`clock_rate`: one clock step per control step without a cadence (whatever the command);
    with `go1_cadence`'s, a quarter less at a standstill, one at 0.75 m/s, a quarter more at
    1.5 m/s, at most 2, the yaw rate aside."""
    command = torch.tensor([[0.0, 0.0, 1.0], [0.6, -0.45, 0.0], [0.0, 1.5, -1.0], [9.0, 0.0, 0.0]])
    state = torch.cat([torch.randn(4, 45), command], dim=1)  # the command at [45:48]
    for task in ("go1_clock", "go1_clock_final", "go1_clock_press"):
        rate = envs.envpool.clock_rate(state, envs.envpool.CLOCK[task])
        assert torch.equal(rate, torch.ones(4))
    cadence = envs.envpool.CLOCK["go1_cadence"]
    assert cadence == {**envs.envpool.CLOCK["go1_clock_final"], "cadence": 1.0 / 3.0}
    assert envs.envpool.CLOCK["go1_cadence_press"] == cadence
    assert envs.envpool.NAMED["go1_cadence_press"] == envs.envpool.NAMED["go1_clock_press"]
    torch.testing.assert_close(
        envs.envpool.clock_rate(state, cadence), torch.tensor([0.75, 1.0, 1.25, 2.0])
    )


def test_the_slow_phase_charges_the_clearance_again_the_slower_the_command():
    """`go1_clock_slow` (`slow_clearance`): `go1_clock_press` plus Playground's clearance term once
    more at a standstill command, half of it at 0.45 m/s, none from 0.9 m/s; `go1_cadence_slow`
    the same with a cadence, at a clearance scale of -45."""
    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    named, clock = envs.envpool.NAMED, envs.envpool.CLOCK
    assert named["go1_clock_slow"] == named["go1_clock_press"]
    assert clock["go1_clock_slow"] == {**clock["go1_clock_press"], "slow_clearance": 1.0}
    assert clock["go1_cadence_slow"] == {**clock["go1_cadence"], "slow_clearance": 1.0}
    hard = {**named["go1_clock_press"][1], "feet_clearance_scale": -45.0}
    assert named["go1_cadence_slow"] == (named["go1_clock_press"][0], hard)
    assert clock["go1_cadence_half"] == {**clock["go1_cadence"], "cadence": 0.5}
    assert named["go1_cadence_half"] == named["go1_cadence"]
    assert clock["go1_cadence_half_slow"] == {**clock["go1_cadence_half"], "slow_clearance": 1.0}
    assert named["go1_cadence_half_slow"] == named["go1_cadence_slow"]
    assert clock["go1_cadence_lean"] == {**clock["go1_cadence"], "slow_clearance": 2.0}
    assert named["go1_cadence_lean"] == named["go1_cadence_press"]
    assert clock["go1_cadence_shape"] == {**clock["go1_cadence_lean"], "phase_height": 4.0}
    assert named["go1_cadence_shape"] == named["go1_cadence_press"]
    # the pushes between `go1_cadence_lean` and `go1_cadence_slow`: clearance scale, slow_clearance
    for name, scale, slow in [
        ("mid", -37.5, 1.4),
        ("firm", -40.0, 1.25),
        ("trim", -38.75, 1.32),
        ("snug", -39.4, 1.285),
    ]:
        assert clock[f"go1_cadence_{name}"] == {**clock["go1_cadence"], "slow_clearance": slow}
        scales = {**named["go1_clock_press"][1], "feet_clearance_scale": scale}
        assert named[f"go1_cadence_{name}"] == (named["go1_clock_press"][0], scales)
    env = envs.make_env("go1_clock_slow", 4, "cpu", 0)
    privileged = np.zeros((4, 123), np.float32)
    privileged[:, 54:57] = (0.0, 0.0, -1.0)
    privileged[:, 45:48] = [(0.0, 0.0, 0.5), (0.0, -0.45, 0.0), (0.9, 0.0, 0.0), (1.2, 0.6, 0.0)]
    info = {"reward_feet_clearance": np.full(4, -2.0, np.float32)}
    rewards, added = env.shape({"privileged_state": privileged}, np.zeros(4, np.float32), info)
    np.testing.assert_allclose(added["reward_slow_clearance"], [-2.0, -1.0, 0.0, 0.0], atol=1e-6)
    without, _ = envs.make_env("go1_clock_press", 4, "cpu", 0).shape(
        {"privileged_state": privileged}, np.zeros(4, np.float32), info
    )
    np.testing.assert_allclose(rewards - without, [-0.04, -0.02, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("task", ["go1_clock", "go1_cadence"])
def test_a_clock_policy_keeps_its_clock_where_the_env_gives_none(tmp_path, task):
    """An actor trained on the clock (`--actor-obs state clock`) is scored on the plain id: the
    tools keep its clock as its memory (the clock steps of the episode so far, turned by the
    command as the task's cadence asks) and give it the same actions as the training task's clock
    does."""
    from tools import policy as tools_policy

    pytest.importorskip("envpool", reason="EnvPool is optional (requirements-dev.txt, Python 3.11)")
    pytest.importorskip("mujoco", reason="MuJoCo is optional (requirements-envs.txt)")
    torch.manual_seed(0)
    actor = ppo_ddp.Actor({"state": [48], "clock": [2]}, 12, (16,), 0.5, True)
    torch.nn.init.normal_(actor.net[-1].weight, std=0.5)  # actions that move the legs
    args = {"task": task}
    state = {"script": "ppo", "actor": actor.state_dict(), "args": args, "iteration": 1}
    torch.save({**state, "configs": {"actor": actor.config}}, tmp_path / "model_1.pt")
    policy = tools_policy.load_policy(str(tmp_path / "model_1.pt"))
    assert policy.obs_shapes == {"state": [48]} and policy.memory_size == 1
    env = envs.make_env(task, 2, "cpu", 0)
    obs, memory = env.get_observations(), tools_policy.initial_memory(policy, 2, "cpu")
    for _ in range(40):
        actions, memory = tools_policy.act(policy, {"state": obs["state"]}, memory)
        assert torch.equal(actions, actor(obs)[0])
        obs, _, dones, _ = env.step(actions)
        memory = memory * (1.0 - dones.float()).unsqueeze(-1)
    if task == "go1_cadence":  # commands away from 0.75 m/s: the clock did not turn one a step
        assert not torch.equal(env.clock_steps, torch.full((2,), 40.0))
    plain = envs.make_env(f"envpool:{GO1}", 2, "cpu", 0).get_observations()
    tools_policy.check_fits(policy, plain)  # the plain id's groups are all it needs
    # exported as a program with a memory row, the clock steps, which gives the same actions
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import export

    out = str(tmp_path / "out")
    config = export.Config(str(tmp_path / "model_1.pt"), out, ["torchscript"], check_envs=2)
    assert export.export(config) == {"torchscript": 0.0}
    assert "clock" in json.loads((tmp_path / "out" / "policy.json").read_text())
    # the clock's period is its task's: a task without one is one clear line
    state["args"] = {"task": "go1_trot"}
    torch.save({**state, "configs": {"actor": actor.config}}, tmp_path / "model_2.pt")
    with pytest.raises(ValueError, match="not among envs/envpool.py's CLOCK tasks"):
        tools_policy.load_policy(str(tmp_path / "model_2.pt"))
