"""The application: what runs the paper's studies on top of the library.

- :mod:`rcdl.app.cli`: the ``rcdl`` command line, generated from the experiments' configs;
- :mod:`rcdl.app.config`: frozen experiment configs, validated in one place;
- :mod:`rcdl.app.runner`: one runner for every experiment (seeds, sub-runs, resume,
  ``finished.json``, device, timing, the run folder);
- :mod:`rcdl.app.report`: tables (mean ± sd over seeds), CSV and figures;
- :mod:`rcdl.app.rundir`: self-describing run folders;
- :mod:`rcdl.app.cifar`, :mod:`rcdl.app.classical`: CIFAR loaders, kNN and SVM baselines;
- :mod:`rcdl.app.allocator`: the command's malloc tuning;
- :mod:`rcdl.app.experiments`: one module (or package) per experiment, holding only what is
  its own.
- :mod:`rcdl.app.recipes`: what several experiments train and report with.
- :mod:`rcdl.app.models`: the model zoo, the networks the experiments and benchmarks train.

An experiment takes from another only what later studies build on: the one-epoch
comparison's settings, report and runs (``cifar10.config``, ``cifar10.report``,
``cifar10.combine``, and ``cifar10`` itself, which the τ sweep runs once per τ), the
continual study's baselines (``continual.baselines``, which the attribution study scores
too), and the attribution study's scores and margins (``attribution.lds``, which the
single-model protocol scores against exact replay). ``tests/test_architecture.py`` checks
that nothing else crosses.

The library (``rcdl``, the package above) never imports from here.
"""
