"""`rljob` command line: one module per command.

- `entry.py`: the parser (`build_parser`) and `main`, which maps errors to exit codes;
- `run_job.py`: `rljob run` (with `launch.py`, the --nproc ranks through torchrun, and `views.py`, its
  tables);
- `validate_job.py`: `rljob validate`;
- `rebuild_report.py`: `rljob report`;
- `export_checkpoint.py`: `rljob export`;
- `build_model.py`: `rljob model build`;
- `rljob simulate` lives with the simulator (`runtime/sim/cli.py`);
- `console.py`: the console they print on and the container's termination message.
"""

from rljob.runtime.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
