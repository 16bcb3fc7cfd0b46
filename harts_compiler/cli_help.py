"""The help formatter of every `harts` command: each option's default is shown after its help, unless the
option has no default of its own (None: the help then says what applies)."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action) -> str:
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)
