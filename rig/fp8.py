"""The test rig for fp8.py: `torchrun fp8.py --mode ...` is ddp.py's data parallelism with FP8
linears, --fp8 tensorwise by default (every other strategy takes --fp8 R too: rig/__init__.py)."""
from harness.cli import main as harness_main

from rig.ddp import DDP


class FP8(DDP):
    """DDP over FP8 linears (fp8.convert; each scale global over the world: fp8.scope)."""
    name = "fp8-ddp"
    plants = {"fp8-amax-per-rank": DDP.plants["fp8-amax-per-rank"]}

    @staticmethod
    def add_args(p):
        DDP.add_args(p)
        p.set_defaults(fp8="tensorwise")


def main():
    """`torchrun fp8.py --mode ...`: fp8.py's __main__ lands here."""
    harness_main(FP8)
