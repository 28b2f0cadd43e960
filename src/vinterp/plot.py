"""Plotting helpers for results read out of traces: each call writes one PNG, returns its path.

matplotlib is imported inside the functions, so `import vinterp` works without it; install
the `plot` extra (`pip install 'vinterp[plot]'`) to use them. Figures are drawn without
pyplot, so they neither open windows nor touch a notebook's backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DPI = 100
TEXT_INCHES = 0.85  # cell width when a cell holds text (a token), else the narrow width below
NARROW_INCHES = 0.3
ROW_INCHES = 0.27


def heatmap(
    values: Any,
    row_labels: Sequence[Any],
    col_labels: Sequence[Any],
    title: str,
    path: str | Path,
    cell_text: Sequence[Sequence[str]] | None = None,
    *,
    xlabel: str = "",
    ylabel: str = "",
    colorbar_label: str = "",
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
) -> Path:
    """A (rows, cols) grid as colours, optionally with text in each cell (e.g. the top token
    of a logit lens). `values` is a tensor (any dtype or device), an array or nested lists."""
    grid = _array(values)
    if grid.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"values have shape {grid.shape}, labels say ({len(row_labels)}, {len(col_labels)})"
        )
    rows, cols = grid.shape
    cell = TEXT_INCHES if cell_text is not None else NARROW_INCHES
    fig = _figure(max(4.0, 2.0 + cell * cols), max(2.5, 1.3 + ROW_INCHES * rows))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    rotation = 0 if cell_text is not None else 90  # text cells are wide enough for a label
    ax.set_xticks(
        range(cols), [_printable(c) for c in col_labels], rotation=rotation, parse_math=False
    )
    ax.set_yticks(range(rows), [_printable(r) for r in row_labels], parse_math=False)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize="medium")
    fig.colorbar(image, ax=ax, label=colorbar_label)
    if cell_text is not None:
        _write_cells(ax, image, grid, cell_text)
    return _save(fig, path)


def line(
    xs: Sequence[float],
    ys_by_label: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: str | Path,
    *,
    references: Mapping[str, float] | None = None,
) -> Path:
    """One line per label over the same xs; `references` adds dashed horizontal lines (a
    baseline, chance level) that a reader compares the lines against."""
    fig = _figure(6.0, 3.8)
    ax = fig.add_subplot()
    for label, ys in ys_by_label.items():
        ax.plot(_array(xs), _array(ys), marker="o", markersize=4, label=label)
    for k, (label, y) in enumerate((references or {}).items()):
        ax.axhline(y, linestyle="--", linewidth=1, color=f"C{len(ys_by_label) + k}", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _array(values: Any) -> Any:
    """A float numpy array; tensors are moved to the CPU as float32 first (numpy has no
    bfloat16, the usual dtype of saved values on a GPU)."""
    import numpy as np

    if hasattr(values, "detach"):
        values = values.detach().float().cpu()
    return np.asarray(values, dtype=float)


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _write_cells(ax: Any, image: Any, grid: Any, cell_text: Sequence[Sequence[str]]) -> None:
    """Text in black or white, whichever reads better on the cell's colour."""
    for r, row in enumerate(cell_text):
        for c, text in enumerate(row):
            red, green, blue, _ = image.cmap(image.norm(grid[r, c]))
            dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
            ax.text(
                c,
                r,
                _printable(text),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if dark else "black",
                parse_math=False,
            )


def _printable(label: Any) -> str:
    """Tokens may hold newlines or tabs; show them escaped so each label stays on one line."""
    return str(label).replace("\n", "\\n").replace("\t", "\\t")


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path
