"""How the diff writes a change in its sentences and verdict line (the terminal and the page
print those sentences as they are)."""
from __future__ import annotations

from .noise import NOISE_SPREADS


def ms(seconds) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.1f} ms"


def signed_ms(seconds) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:+.1f} ms"


def change_text(change: dict) -> str:
    """'+28.3 ms (+8.1%)'."""
    fraction = change.get("fraction")
    return signed_ms(change["delta_s"]) + ("" if fraction is None else f" ({fraction:+.1%})")


def noise_text(change: dict) -> str:
    """'beyond noise (3 x 4.8 ms)', 'within noise (...)', or 'noise unknown (one step)'."""
    noise = change.get("noise_s")
    if change.get("significant") is None:
        return "noise unknown (a single step and rank per stage)"
    where = "beyond" if change["significant"] else "within"
    return f"{where} noise ({NOISE_SPREADS:g} x {ms(noise)})"


def stages_text(stages) -> str:
    stages = sorted(stages)
    return f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(str(s) for s in stages)
