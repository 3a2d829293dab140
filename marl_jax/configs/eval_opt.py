"""eval_opt workflow presets: get_config("") is the embedded CPU run, get_config("<model>,<task>") the reference
settings (see marl_jax/config.py). `python launch/run.py --config=configs/eval_opt.py[:<model>,<task>]` reads this."""
from marl_jax import config as common


def get_config(arg: str = ""):
    c = common.base_config("eval_opt", ('generator', 'evaluator'))
    c.workflow_options.max_iterations = 3  # 3 on math, 2 on code in the reference
    # "quoted": each call quotes the history in one user message; "chat": one multi-turn chat per role,
    # whose prompts extend the role's previous prompt + completion (the sampler's prefix cache reuses them)
    c.workflow_options.conversation = "quoted"
    c = common.apply_preset(c, arg)
    if c.task.kind == "code":
        c.workflow_options.max_iterations = 2
    return c
