"""Convert a dataset as you hold it (an ImageNet-layout folder, ImageNet's tars, Kaggle's layout, parquet, WebDataset
tars, lists) to WebDataset shards: OUT/<split>/shard-NNNNNN.tar + .idx, OUT/manifest.json last
(pipeline/convert/wds.py; `--help` lists the options).

    python tools/convert_wds.py SRC OUT [--max-resolution 512] ...
"""
from pipeline.convert.wds import command

if __name__ == "__main__":
    command()
