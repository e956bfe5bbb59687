"""Public path of fault injection (``FTH_INJECT``; defined in :mod:`.core.inject`)."""

from .core.inject import FORMS, INJECT_ENV, KINDS, InjectedFault, Injection, Injector, parse, step

__all__ = ["FORMS", "INJECT_ENV", "KINDS", "InjectedFault", "Injection", "Injector", "parse", "step"]
