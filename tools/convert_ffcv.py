"""Convert a dataset as you hold it (an ImageNet-layout folder, ImageNet's tars, Kaggle's layout, parquet, WebDataset
tars, lists) to FFCV: OUT/train.beton, OUT/val.beton, OUT/manifest.json last
(pipeline/convert/ffcv.py; `--help` lists the options).

    python tools/convert_ffcv.py SRC OUT [--max-resolution 512] ...
"""
from pipeline.convert.ffcv import command

if __name__ == "__main__":
    command()
