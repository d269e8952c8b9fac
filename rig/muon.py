"""The test rig for muon.py (rig/__init__.py): `torchrun muon.py --mode ...` runs zero.py's rig
with --optimizer muon (ZeRO's flat shards cut the matrices: the owner mode, or --muon-mode
gather). Each strategy's rig builds its Muon itself (rig/ddp.make_optimizer: replicated and
tp-gather; rig/zero.optimizer_on_shards: owner and gather)."""
import sys

from rig.zero import main as zero_main


def main():
    if "--optimizer" not in sys.argv:
        sys.argv += ["--optimizer", "muon"]
    zero_main()
