"""Fixtures: a real superfluid daemon per test module.

The binary is SUPERFLUID_BIN, else $CARGO_TARGET_DIR/debug/superfluid, else
~/.cache/superfluid/target/debug/superfluid; the model SUPERFLUID_TEST_MODEL,
else the default SmolLM2. A module may set ``MODEL = "<file name>"`` to run on
a derived test model beside the default one (e.g. the tools-think model), and
``EXTRA_ARGS = [...]`` to pass more flags to ``superfluid serve``.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Tests run against the source tree when the package is not installed.
sys.path.insert(0, ROOT)

from superfluid_client.daemon import Daemon, default_model, derived_model  # noqa: E402


def module_model(module) -> str:
    name = getattr(module, "MODEL", None)
    return derived_model(name) if name else default_model()


@pytest.fixture(scope="module")
def daemon(request):
    """A daemon on a temp sessions dir, --web on a free port, for the module."""
    model = module_model(request.module)
    if not os.path.exists(model):
        pytest.skip("no model at {} (run scripts/setup.sh)".format(model))
    d = Daemon(model=model, extra_args=getattr(request.module, "EXTRA_ARGS", None))
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def sf(daemon):
    """A Client of the module's daemon."""
    return daemon.client()
