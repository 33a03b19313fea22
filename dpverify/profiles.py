"""dpverify's Hypothesis settings profiles, registered with Hypothesis on import.

``dpverify-dev`` (few examples, for the edit-run loop), ``dpverify-ci`` (derandomized, no
database: the same examples on every run of the same code, in a process that loaded the
same modules: Hypothesis also draws, now and then, from the literals of the local modules
loaded at the time; this repository's ``conftest.py`` turns that off) and ``dpverify-fuzz`` (10,000 examples). The
pytest plugin, the command line (``dpverify fuzz --profile``) and this repository's
``conftest.py`` load them from here; importing this module imports Hypothesis, not torch.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

__all__ = ["PROFILES"]

_QUIET_CHECKS = (HealthCheck.too_slow, HealthCheck.data_too_large)

# Hypothesis loads its own "ci" profile (derandomized, no database) when it detects CI, and
# settings() inherits from the profile loaded at the time: build on "default" instead, so
# that dpverify-dev and dpverify-fuzz stay random and keep their example database in CI.
_BASE = settings.get_profile("default")

#: The Hypothesis profiles dpverify registers, by name.
PROFILES: dict[str, settings] = {
    # Few examples for the edit-run loop; a DataParallel step is slow, so no deadline.
    "dpverify-dev": settings(_BASE, max_examples=10, deadline=None, derandomize=False),
    # Same examples on every run, and a reproduction blob with every failure. No database:
    # a derandomized CI run should depend on the code alone, not on a stale .hypothesis/.
    "dpverify-ci": settings(
        _BASE,
        max_examples=25,
        derandomize=True,
        deadline=None,
        print_blob=True,
        database=None,
        suppress_health_check=_QUIET_CHECKS,
    ),
    "dpverify-fuzz": settings(
        _BASE,
        max_examples=10_000,
        derandomize=False,
        deadline=None,
        print_blob=True,
        suppress_health_check=_QUIET_CHECKS,
    ),
}

# Registered at import: the pytest plugin imports this module before any pytest_configure,
# so that Hypothesis' own plugin can load them for --hypothesis-profile.
for _name, _profile in PROFILES.items():
    settings.register_profile(_name, _profile)
