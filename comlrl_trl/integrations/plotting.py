"""Reward curves from a trainer's log history (matplotlib, installed with the `demo` extra)."""

import os


def reward_curve_series(log_history: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """`{metric: (env_steps, values)}` for every `turn_k/reward_mean` and `eval/turn_k/reward_mean` logged."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for row in log_history:
        for key, value in row.items():
            if key.endswith("/reward_mean") and key.startswith(("turn_", "eval/turn_")) and "env_step" in row:
                steps, values = series.setdefault(key, ([], []))
                steps.append(row["env_step"])
                values.append(value)
    return series


def plot_reward_curve(log_history: list[dict], path: str | os.PathLike, title: str = "Joint reward") -> str:
    """Draw training (thin, with a running mean) and evaluation reward against env_step into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = reward_curve_series(log_history)
    if not series:
        raise ValueError("The log history has no reward metrics to plot (was anything logged?).")
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, (steps, values) in sorted(series.items()):
        if key.startswith("eval/"):
            axis.plot(steps, values, marker="o", linewidth=2, label=key)
        else:
            (line,) = axis.plot(steps, values, alpha=0.35, linewidth=1, label=key)
            window = max(1, len(values) // 10)
            smooth = [
                sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))
            ]
            axis.plot(steps, smooth, color=line.get_color(), linewidth=2, label=f"{key} (running mean)")
    axis.set_xlabel("env_step (joint actions scored)")
    axis.set_ylabel("reward")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return os.fspath(path)
