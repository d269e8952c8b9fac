"""trainer4d: the 4D trainer's helpers, beside compose4d.py (which imports them; none imports it).

    train.py        `compose4d.py --mode train`: a logged run with checkpoints, SIGTERM
                    preemption (also mid-step), elastic restarts, real text, held-out evaluation
    checkpoint.py   layout-independent, atomic checkpoints and the HF export
    elastic.py      the batch re-planner for a changed world size (`compose4d.py plan`)
    comm.py         compose4d's communication per step by group: the benchmark's formula rows
    plan.py         `python -m trainer4d.plan`: one GPU's model states, activations, bubble and
                    communication for a cluster layout, from the strategies' formulas

A package with its own name, so that a user's own train.py or checkpoint.py next to their
script never shadows ours. It sits above the strategy files (plan.py reads pp's bubble and
oom_search's memory model); harness/ sits below them and imports neither.
"""
