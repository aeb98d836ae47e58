"""`megaresil convert` as a script, for those who look for it under tools/:

    python tools/convert_checkpoint.py SRC DST --tp 4 --pp 1 --backend zarr
    python tools/convert_checkpoint.py SRC --to-hf HF_DIR
    python tools/convert_checkpoint.py --from-hf HF_DIR DST --tp 2

Every option is the CLI's (`megaresil convert --help`).
"""
import sys

from megaresil.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
