"""``rmt-plan comm``'s plot: where the number- and dimension-wise partitions cost the same
(:mod:`rmt.memory.comm_volume`, UltraMem Appendix D), like the paper's Fig. 9."""

from __future__ import annotations

from rmt.memory.comm_volume import plan_comm


def plot_decision_boundary(
    path: str,
    tokens: int,
    topm: int,
    *,
    p_max: int = 64,
    v_dim_max: int = 512,
    phase: str = "forward",
    mark: tuple[int, int] | None = None,
    **options,
) -> None:
    """Write a PNG like the paper's Fig. 9: number/dimension volume ratio over P x v_dim.

    The solid curve is ratio = 1; the shaded region is where number-wise sends more
    (dimension-wise is the choice), the other where number-wise sends less. ``mark``
    = (P, v_dim) puts a dot on the configuration being planned.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    cores = options.get("cores", 1)
    ps = np.arange(2, max(p_max, 3) + 1)
    step = max(cores, (v_dim_max // 200) // cores * cores)
    dims = np.arange(cores, max(v_dim_max, 2 * cores) + 1, step)
    ratio = np.empty((len(dims), len(ps)))
    for j, p in enumerate(ps):
        for i, d in enumerate(dims):
            ratio[i, j] = plan_comm(tokens, topm, int(d), int(p), phase=phase, **options)["ratio"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    top = max(float(ratio.max()), 1.0) + 1.0
    ax.contourf(ps, dims, ratio, levels=[0.0, 1.0, top], colors=["#e8f0fa", "#f6c8a8"])
    if ratio.min() < 1.0 < ratio.max():
        ax.contour(ps, dims, ratio, levels=[1.0], colors="k", linewidths=1.5)
    if mark is not None:
        ax.plot([mark[0]], [mark[1]], "o", color="crimson")
    ax.legend(
        handles=[
            Patch(color="#f6c8a8", label="number/dimension > 1: dimension-wise"),
            Patch(color="#e8f0fa", label="number/dimension < 1: number-wise"),
        ],
        loc="upper left",
        fontsize=8,
    )
    ax.set_xlabel("group size P")
    ax.set_ylabel("v_dim")
    ax.set_title(f"number / dimension = 1 (T={tokens}, top-m={topm}, {phase})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
