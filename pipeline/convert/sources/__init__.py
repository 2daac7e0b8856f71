"""Sources: data as users hold it, read in place, for both converters. One file per form:

- `imagefolder`: `SRC/<split>/<class>/<image>`;
- `imagenet`: ImageNet's official files (the train tar of class tars, the val tar, the devkit);
- `kaggle`: ImageNet in Kaggle's layout (`ILSVRC/Data/CLS-LOC`, `LOC_val_solution.csv`);
- `parquet`: Hugging Face image-classification parquet (`data/<split>-NNNNN-of-NNNNN.parquet`);
- `webdataset`: WebDataset tars another tool wrote (`KEY.jpg` with `KEY.cls` or `KEY.json`);
- `list`: `train.csv`/`val.csv` or `.jsonl` of paths and labels.

`open_source` finds which form SRC holds (or takes `--source-format`), and a converter then asks
the source for classes, entries and bytes (`base.Source`) without knowing where they come from.
"""
from __future__ import annotations

from pipeline.convert.errors import ConversionError
from pipeline.convert.sources.base import Entries, Missing, Source, SourceOptions
from pipeline.convert.sources.files import open_files
from pipeline.convert.sources.imagefolder import ImageFolderSource
from pipeline.convert.sources.imagenet import ImageNetSource
from pipeline.convert.sources.kaggle import KaggleSource
from pipeline.convert.sources.lists import ListSource
from pipeline.convert.sources.parquet import ParquetSource
from pipeline.convert.sources.survey import survey
from pipeline.convert.sources.webdataset import WebDatasetSource

FORMS: dict[str, type[Source]] = {cls.form: cls for cls in (ImageFolderSource, ImageNetSource, KaggleSource,
                                                             ParquetSource, WebDatasetSource, ListSource)}

__all__ = ["Entries", "FORMS", "Missing", "Source", "SourceOptions", "open_source"]


def open_source(src: str, options: SourceOptions, splits: list[str] = ()) -> Source:
    """The source SRC holds: of the form `options.form`, else the one form found there; else a
    ConversionError listing what was found."""
    files = open_files(src)
    if options.form:
        chosen = FORMS[options.form]
        if files.remote and not chosen.remote_ok:
            raise ConversionError(f"{files.root}: the {chosen.form} form is read from local disk only; copy it to a "
                                  f"local folder, or use a form read from URLs "
                                  f"({', '.join(f for f, c in FORMS.items() if c.remote_ok)})")
        return chosen(files, options)
    found = {form: evidence for form, chosen in FORMS.items()
             if (chosen.remote_ok or not files.remote) and (evidence := chosen.found(files, list(splits)))}
    if len(found) == 1:
        form = next(iter(found))
        return FORMS[form](files, options)
    if not found:
        raise ConversionError(f"{files.root}: no known source form ({survey(files)}); the forms: "
                              f"{', '.join(FORMS)} (docs/loaders.md, Converting ImageNet)")
    listed = "; ".join(f"{form}: {evidence}" for form, evidence in found.items())
    raise ConversionError(f"{files.root}: holds more than one source form ({listed}); choose one with --source-format")
