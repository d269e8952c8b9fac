"""The test rig for muon.py (rig/__init__.py): `torchrun muon.py --mode ...` runs zero.py's rig
with --optimizer muon (ZeRO's flat shards cut the matrices: the gather mode). Each strategy's
rig builds its Muon itself (rig/ddp.make_optimizer: replicated and tp-gather; rig/zero's
adamw_on_shards: gather)."""
import sys

from rig.zero import main as zero_main


def main():
    if "--optimizer" not in sys.argv:
        sys.argv += ["--optimizer", "muon"]
    zero_main()
