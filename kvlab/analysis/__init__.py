"""Results and analysis, the top layer: runs and sweeps read back as pandas tables, the standard plots
(``sweeps``), the highest rate within an SLO (``capacity``), spread over repeats (``spread``) and wandb's
offline records (``wandb_read``). It may import every layer below; nothing in kvlab imports it.

``kvlab.analysis`` is the notebooks' entry point: ``from kvlab import analysis; analysis.load_sweep(...)``
reaches every public function of ``sweeps`` (listed there)."""
from kvlab.analysis.sweeps import (  # noqa: F401 - the public face of the package
    add_predictions,
    figures,
    load_results,
    load_run,
    load_sweep,
    load_timeline,
    load_wandb,
    max_rate_under_slo,
    over_repeats,
    overrides,
    plot_bandwidth,
    plot_link_ratio,
    plot_load,
    plot_memory,
    plot_parallel_heatmap,
    plot_plan,
    plot_prediction,
    plot_timeline,
    plot_wandb_panels,
    point_columns,
    predict_dir,
    run_dirs,
    run_sweep,
)
