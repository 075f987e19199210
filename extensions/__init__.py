"""PPO's extensions, kept apart as rsl_rl 5.5.1 keeps them in `rsl_rl/extensions/`: RND (rnd.py),
symmetry (symmetry.py) and reward scaling (reward_scaling.py). Each is a module of functions that
ppo_ddp.py calls in short plain `if` blocks where it acts. No training script is imported here.
"""
