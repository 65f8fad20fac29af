"""attribute_replaced (adapters/helpers.py) puts the replaced attribute back, after an error as well."""

import pytest


def test_replaced_attribute_comes_back_after_an_error():
    import types

    from comlrl_trl.adapters.helpers import attribute_replaced

    module = types.SimpleNamespace(pick=min)
    with pytest.raises(RuntimeError), attribute_replaced(module, "pick", max):
        assert module.pick(1, 2) == 2
        raise RuntimeError("generation failed")
    assert module.pick(1, 2) == 1
