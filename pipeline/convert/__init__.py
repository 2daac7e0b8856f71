"""The converters: an ImageNet-layout folder to WebDataset shards (`wds`) or an FFCV `.beton`
(`ffcv`), locally or into object storage, the manifest last. They never import torch.

    python pipeline/convert/wds.py SRC OUT      (or fastpipe-convert-wds SRC OUT once installed)
"""
