"""What the model CLIs share: the communication settings and TP options
(:mod:`models.cli.settings`), the argument check (:mod:`models.cli.checks`), the error
convention and the setup they imply (:mod:`models.cli.running`).

Errors (docs/models.md, "CLI errors"): every CLI's ``main`` calls :func:`check` right after
parsing, before it imports jax's backends or loads a model; a bad argument is reported by
argparse (``usage: ...`` then ``<prog>: error: <message>``, exit status 2). What only the run can
find (a corrupt checkpoint, a chat template over its limits, a text too short for one window)
goes through :func:`run_checked`: the same ``<prog>: error: <message>`` line, exit status 2,
never a traceback.
"""

from models.cli.checks import check, check_comm, model_heads, tp_list
from models.cli.running import RUN_ERRORS, fail, run_checked, run_main, set_devices, setup
from models.cli.settings import (CONFIG_FLAGS, add_common, build_comm, comm_from_args,
                                 config_fields, describe, flag_options, format_setting,
                                 load_policy, parse_setting, quantize_every_call, read_regular,
                                 setting_options)

__all__ = ["check", "check_comm", "model_heads", "tp_list", "RUN_ERRORS", "fail", "run_checked",
           "run_main", "set_devices", "setup", "CONFIG_FLAGS", "add_common", "build_comm",
           "comm_from_args", "config_fields", "describe", "flag_options", "format_setting",
           "load_policy", "parse_setting", "quantize_every_call", "read_regular",
           "setting_options"]
