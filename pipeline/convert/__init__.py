"""The converters: data in the form users hold it (`sources/`: an ImageNet-layout folder, ImageNet's
official tars, Kaggle's layout, Hugging Face parquet, WebDataset tars, lists; on disk or in a bucket)
to WebDataset shards (`wds`) or an FFCV `.beton` (`ffcv`), locally or into object storage, the
manifest last. They never import torch.

    python pipeline/convert/wds.py SRC OUT      (or fastpipe-convert-wds SRC OUT once installed)
"""
