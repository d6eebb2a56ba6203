"""What a Parquet dataset's footers tell about its columns without decoding them.

``one_value``: the columns whose statistics say they hold one value in every row of every file. Integers and
booleans: min = max and no null in every row group, or null throughout; floats only null throughout (Parquet
statistics leave NaN out, so min = max does not say that no row is NaN). A file without statistics or without the
column, a column whose physical type is not a number: not one value.
"""

from __future__ import annotations

from typing import Iterator

import pyarrow.dataset as ds

NULL = object()  # one_value: a column null in every row


def fragments(dataset: ds.Dataset) -> Iterator:
    for d in getattr(dataset, "children", None) or [dataset]:
        yield from d.get_fragments()


def same(a: object, b: object) -> bool:
    return a is b if a is NULL or b is NULL else a == b


def one_value(dataset: ds.Dataset, columns: dict[str, bool]) -> dict[str, object]:
    """``columns`` (name -> whether it is a float) that hold one value in every row of ``dataset``'s files -> that
    value as the statistics give it (``NULL``: null everywhere)."""
    candidates: dict[str, object] = {c: None for c in columns}  # (value not known yet)
    floats = {c for c, f in columns.items() if f}
    physical = {"INT32", "INT64", "BOOLEAN", "FLOAT", "DOUBLE"}
    for frag in fragments(dataset):
        if not candidates:
            break
        md = frag.metadata
        if md.num_rows == 0:
            continue
        if md.num_row_groups == 0:
            return {}
        first = md.row_group(0)
        where = {first.column(i).path_in_schema: i for i in range(first.num_columns)}
        for c in list(candidates):
            i = where.get(c)
            if i is None:
                del candidates[c]
                continue
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                col = rg.column(i)
                st = col.statistics if col.is_stats_set else None
                if rg.num_rows == 0:
                    continue
                if st is None or col.physical_type not in physical or not st.has_null_count:
                    value = None
                elif st.null_count == rg.num_rows:
                    value = NULL
                elif st.null_count == 0 and st.has_min_max and st.min == st.max and c not in floats:
                    value = st.min
                else:
                    value = None
                seen = candidates[c]
                if value is None or (seen is not None and not same(seen, value)):
                    del candidates[c]
                    break
                candidates[c] = value
    return {c: v for c, v in candidates.items() if v is not None}


