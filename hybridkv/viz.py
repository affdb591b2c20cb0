"""Memory maps of a plan: which bytes of one allocation unit hold which layer's K, V or state.

Everything is read from the plan: the rows of a unit from :meth:`MemoryPlan.unit_rows`, the
bytes in them from the placements' ``parts`` (:meth:`KVPlacement.parts`,
:meth:`StatePlacement.parts`), so a drawing shows what the kernels would address, not a diagram
drawn by hand. An *allocation unit* is what the allocator hands to one group at a time (a block
id of a shared or per-group pool, a large page of a two-level pool).

:func:`unit_map` computes the segments; :func:`draw_unit` and :func:`memory_map_figure` draw them
with matplotlib (imported lazily, so the rest of the package does not need it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan import MemoryPlan

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PART_COLORS", "Segment", "UnitMap", "draw_unit", "memory_map_figure", "unit_map"]

#: colour of each kind of bytes (K, V, K and V interleaved in vLLM's formats, MLA latent,
#: sparse-attention indexer keys, GLM-5-Next's tail ring in vLLM's formats, conv state,
#: SSM/recurrent state, padding)
PART_COLORS = {
    "K": "#1f77b4",
    "V": "#ff7f0e",
    "K|V": "#7f7f7f",
    "latent": "#17becf",
    "indexer": "#e377c2",
    "ring": "#8c564b",
    "conv": "#2ca02c",
    "ssm": "#9467bd",
    "state": "#bcbd22",
    "padding": "#d9d9d9",
}


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of row ``row`` of a unit: ``part`` of ``layer`` (decoder layer
    ``layer_index``) for block id ``block_id`` (``layer`` is empty and the index -1 for
    padding)."""

    row: int
    start: int
    end: int
    layer: str
    part: str
    block_id: int
    layer_index: int = -1


@dataclass(frozen=True)
class UnitMap:
    """One allocation unit owned by one group, as rows of equal width ``row_bytes``."""

    layout: str
    group_id: int
    group_kind: str
    unit: int
    row_labels: tuple[str, ...]
    row_bytes: int
    segments: tuple[Segment, ...]
    hidden_rows: int = 0  # rows left out (they look like the ones shown)

    def bytes_by_part(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.part] = out.get(s.part, 0) + s.end - s.start
        return out


def unit_map(plan: MemoryPlan, group_id: int, unit: int = 1, *, max_rows: int = 8) -> UnitMap:
    """The segments of allocation unit ``unit`` while group ``group_id`` owns it.

    Unit 0 holds the null block in every pool, so the default is unit 1. Rows past ``max_rows``
    are left out and counted in :attr:`UnitMap.hidden_rows`.
    """
    group = plan.group(group_id)
    rows = plan.unit_rows(group_id, unit)
    width = rows[0].nbytes
    shown = min(len(rows), max_rows)
    segments: list[Segment] = []
    for i, row in enumerate(rows[:shown]):
        for layer in row.layers:
            p = plan.placement(layer)
            for part, region in p.parts(row.block_id):
                start, end = region.start - row.start, region.end - row.start
                if region.tensor != row.tensor or not 0 <= start < end <= width:
                    raise ValueError(
                        f"{layer} block {row.block_id}: bytes {start}..{end} fall outside its "
                        f"unit row of {width} B"
                    )
                color = part if part in PART_COLORS else "state"
                segments.append(Segment(i, start, end, layer, color, row.block_id, p.layer_index))
    # what no layer uses inside a row is padding
    for row in range(shown):
        cursor = 0
        for s in sorted((s for s in segments if s.row == row), key=lambda s: s.start):
            if s.start > cursor:
                segments.append(Segment(row, cursor, s.start, "", "padding", -1))
            cursor = max(cursor, s.end)
        if cursor < width:
            segments.append(Segment(row, cursor, width, "", "padding", -1))
    segments.sort(key=lambda s: (s.row, s.start))
    return UnitMap(
        layout=plan.layout if plan.pack_size <= 1 else f"{plan.layout}({plan.pack_size})",
        group_id=group_id,
        group_kind=group.kind,
        unit=unit,
        row_labels=tuple(r.label for r in rows[:shown]),
        row_bytes=width,
        segments=tuple(segments),
        hidden_rows=len(rows) - shown,
    )


def _scale(nbytes: int) -> tuple[float, str]:
    if nbytes >= 2 * 2**20:
        return 2**20, "MiB"
    if nbytes >= 2 * 2**10:
        return 2**10, "KiB"
    return 1, "B"


def draw_unit(ax: Axes, m: UnitMap, *, title: str | None = None) -> None:
    """Draw one unit map on ``ax``: a bar per row, coloured by part, layer numbers inside."""
    scale, unit = _scale(m.row_bytes)
    layer_rank = {name: i for i, name in enumerate(dict.fromkeys(s.layer for s in m.segments))}
    for s in m.segments:
        x0, w = s.start / scale, (s.end - s.start) / scale
        # alternate the shade of neighbouring layers so their boundaries show
        alpha = 0.55 if layer_rank.get(s.layer, 0) % 2 else 0.95
        ax.barh(
            s.row,
            w,
            left=x0,
            height=0.8,
            color=PART_COLORS[s.part],
            alpha=1.0 if s.part == "padding" else alpha,
            hatch="//" if s.part == "padding" else None,
            edgecolor="white",
            linewidth=0.4,
        )
        if s.layer and w / (m.row_bytes / scale) > 0.06:
            ax.text(
                x0 + w / 2,
                s.row,
                f"{s.part}{s.layer_index}",
                ha="center",
                va="center",
                fontsize=6,
                color="black",
            )
    ax.set_yticks(range(len(m.row_labels)))
    ax.set_yticklabels(m.row_labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, m.row_bytes / scale)
    ax.set_xlabel(f"offset within the row ({unit})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    more = f"; {m.hidden_rows} more rows alike" if m.hidden_rows else ""
    ax.set_title(
        title or f"{m.layout}: unit {m.unit} owned by group {m.group_id} ({m.group_kind}){more}",
        fontsize=8,
    )


def _legend_handles(parts: set[str] | None = None):
    """Legend entries for the kinds of bytes drawn (all kinds when ``parts`` is None)."""
    from matplotlib.patches import Patch

    return [
        Patch(facecolor=c, hatch="//" if k == "padding" else None, edgecolor="white", label=k)
        for k, c in PART_COLORS.items()
        if parts is None or k in parts
    ]


def memory_map_figure(plans: dict[str, MemoryPlan], *, model_label: str = "") -> Figure:
    """One row per plan: a unit owned by its first attention group and one owned by its first
    state group, side by side, with a shared legend."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plans), 2, figsize=(11, 1.9 * len(plans) + 0.8), squeeze=False)
    drawn: set[str] = set()  # the legend lists only kinds this model's maps contain
    for (name, plan), row in zip(plans.items(), axes):
        attn = plan.attention_groups[0].group_id
        state = plan.state_groups[0].group_id if plan.state_groups else None
        maps = [(row[0], unit_map(plan, attn))]
        if state is None:
            row[1].axis("off")
        else:
            maps.append((row[1], unit_map(plan, state)))
        for ax, m in maps:
            draw_unit(ax, m)
            drawn |= set(m.bytes_by_part())
        row[0].set_ylabel(name, fontsize=9)
    handles = _legend_handles(drawn)
    fig.legend(handles=handles, loc="lower center", ncol=max(1, len(handles)), fontsize=8)
    fig.suptitle(
        "Memory map of one allocation unit per layout"
        + (f" ({model_label})" if model_label else "")
        + ": K/V pages of attention layers (left), recurrent states (right)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return fig
