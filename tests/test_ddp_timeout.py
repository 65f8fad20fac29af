"""`ddp_timeout` on the process group (`checkpoint.apply_ddp_timeout`): set through torch's private setter, and a
warning, not silence, where that setter is missing or fails (the waits then keep gloo's 30 minutes)."""

import datetime
import warnings

import pytest
import torch.distributed as dist

from comlrl_trl.checkpoint import apply_ddp_timeout


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_timeout_is_set_on_the_default_group(one_process_group, monkeypatch):
    calls = []
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda timeout, *a, **k: calls.append(timeout))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_ddp_timeout(7)
    assert calls == [datetime.timedelta(seconds=7)]


def test_the_real_setter_of_this_torch_takes_it_without_a_warning(one_process_group):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_ddp_timeout(42)


@pytest.mark.parametrize("how", ["missing", "failing"])
def test_a_timeout_that_cannot_be_set_warns(how, one_process_group, monkeypatch):
    if how == "missing":
        monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
        reason = "AttributeError: torch.distributed.distributed_c10d has no _set_pg_timeout"
    else:

        def failing(timeout, *args, **kwargs):
            raise RuntimeError("not supported by this backend")

        monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", failing)
        reason = "RuntimeError: not supported by this backend"
    with pytest.warns(UserWarning, match="ddp_timeout=5 s could not be set on the process group") as caught:
        apply_ddp_timeout(5)
    assert reason in str(caught[0].message) and "30 minutes" in str(caught[0].message)


def test_nothing_happens_without_a_process_group(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_ddp_timeout(5)  # no group: nothing to set, nothing to warn about
