"""Values an attacker would hide in a checkpoint, for the tests that prove cairn
refuses them without running anything."""

from __future__ import annotations

import os


class Hostile:
    """Unpickling this runs a command: it touches `marker` (a path), so a test can
    tell whether it ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
