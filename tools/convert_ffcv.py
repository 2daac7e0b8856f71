"""Convert an ImageNet-layout folder to FFCV: OUT/train.beton, OUT/val.beton, OUT/manifest.json last
(pipeline/convert/ffcv.py; `--help` lists the options).

    python tools/convert_ffcv.py SRC OUT [--max-resolution 512] ...
"""
from pipeline.convert.ffcv import command

if __name__ == "__main__":
    command()
