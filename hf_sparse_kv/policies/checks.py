"""The construction-time warning shared by the policies with a budget: a budget below what is always attended."""

from __future__ import annotations

import warnings


def warn_budget_below_forced(name: str, budget: float, sink: int, window: int) -> None:
    """Warn when an int ``budget`` is below ``sink + window``, the tokens a policy attends whatever its budget.

    Such a policy behaves as ``budget=sink + window`` (the selection never drops the sink, the window or the current
    block), so the warning gives that effective budget. A fraction of the context is not checked: it falls below
    ``sink + window`` at every context shorter than ``(sink + window) / budget``, which is expected.
    """
    forced = sink + window
    if isinstance(budget, int) and not isinstance(budget, bool) and budget < forced:
        warnings.warn(
            f"{name}(budget={budget}) is below sink + window = {sink} + {window} = {forced} tokens, which are always "
            f"attended: it reads what budget={forced} reads. Raise the budget or lower sink/window.",
            UserWarning,
            stacklevel=4,  # the line that built the policy: this function <- __post_init__ <- __init__ <- caller
        )
