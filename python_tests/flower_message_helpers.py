"""Shared pieces of the Flower Message-API tests (python_tests/test_flower_message_*.py):
reply builders (real ``Message`` objects and ``Mock(spec=Message)`` ones without a numeric
node id, as Flower's own strategy tests build them), a stand-in ``Grid``, and comparisons of
ArrayRecords, MetricRecords and strategy state between Flower's class and ours."""

from __future__ import annotations

import time
from collections.abc import Callable
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)


@pytest.fixture
def task_identity():
    """configure_train builds Messages, which read the ServerApp process's identity."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    yield
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = saved


class StandInGrid:
    """The part of ``flwr.serverapp.Grid`` that ``configure_train`` uses."""

    def __init__(self, node_ids):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return list(self.node_ids)


def arrayrecord(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def real_reply(node: int, arrays: dict[str, np.ndarray] | None,
               metrics: dict | None) -> Message:
    """A reply as a SuperLink delivers it: a Message with metadata and a RecordDict."""
    metadata = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0,
                        reply_to_message_id="m", group_id="", created_at=time.time(),
                        ttl=3600.0, message_type=MessageType.TRAIN)
    return Message(metadata=metadata, content=content(arrays, metrics))


def mock_reply(arrays: dict[str, np.ndarray] | None, metrics: dict | None) -> Message:
    """A reply as Flower's strategy tests build it: ``Mock(spec=Message)`` with a real
    content; its metadata (and so its node id) is a Mock."""
    message = Mock(spec=Message)
    message.content = content(arrays, metrics)
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


def error_reply(node: int) -> Message:
    """A reply that carries an error instead of content (Flower logs and skips it)."""
    message = Mock(spec=Message)
    message.has_error.side_effect = lambda: True
    message.has_content.side_effect = lambda: False
    message.metadata.src_node_id = node
    message.error.reason = "client failed"
    return message


def content(arrays: dict[str, np.ndarray] | None, metrics: dict | None) -> RecordDict:
    records = {}
    if arrays is not None:
        records["arrays"] = arrayrecord(arrays)
    if metrics is not None:
        records["metrics"] = MetricRecord(dict(metrics))
    return RecordDict(records)


def as_numpy(value):
    """ArrayRecord, dict of Arrays/ndarrays or list of ndarrays as plain NumPy structures."""
    if value is None:
        return None
    if isinstance(value, (ArrayRecord, dict)):
        return {k: v.numpy() if isinstance(v, Array) else np.asarray(v) for k, v in value.items()}
    if isinstance(value, list):
        return [np.asarray(v) for v in value]
    return value


def assert_arrays_equal(ours, theirs, rtol: float, atol: float, what: str = "arrays") -> None:
    """Same keys in the same order, same dtypes and shapes, values equal to the tolerance
    (NaN where Flower has NaN)."""
    ours, theirs = as_numpy(ours), as_numpy(theirs)
    if theirs is None or ours is None:
        assert ours is None and theirs is None, f"{what}: {ours!r} vs {theirs!r}"
        return
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{what}: keys {list(ours)} vs {list(theirs)}"
        pairs = [(k, ours[k], theirs[k]) for k in theirs]
    else:
        assert len(ours) == len(theirs), f"{what}: {len(ours)} vs {len(theirs)} arrays"
        pairs = [(str(i), a, b) for i, (a, b) in enumerate(zip(ours, theirs))]
    for key, a, b in pairs:
        assert a.dtype == b.dtype, f"{what}[{key}]: dtype {a.dtype}, Flower's {b.dtype}"
        assert a.shape == b.shape, f"{what}[{key}]: shape {a.shape}, Flower's {b.shape}"
        if a.dtype.kind in "biu":
            np.testing.assert_array_equal(a, b, err_msg=f"{what}[{key}]")
        else:
            # atol is relative to the array's magnitude: the fp32 rounding of values ~3 is
            # ~3x that of values ~1.
            finite = np.abs(b[np.isfinite(b)]) if b.size else np.zeros(0)
            scale = max(1.0, float(finite.max())) if finite.size else 1.0
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True,
                                       err_msg=f"{what}[{key}]")


def assert_metrics_equal(ours, theirs) -> None:
    if theirs is None:
        assert ours is None
        return
    assert isinstance(ours, MetricRecord)
    assert list(ours) == list(theirs)

    def same(a, b):
        if isinstance(b, list):
            return isinstance(a, list) and len(a) == len(b) and all(map(same, a, b))
        return a == b or (a != a and b != b)  # NaN where Flower has NaN

    for k in theirs:
        assert same(ours[k], theirs[k]), f"metric {k}: {ours[k]!r} vs Flower's {theirs[k]!r}"


def outcome(call: Callable[..., object], *args):
    """(result, None) or (None, exception) of ``call(*args)``."""
    try:
        return call(*args), None
    except Exception as err:  # noqa: BLE001 - compared with Flower's by type
        return None, err


def assert_same_exception(ours: BaseException | None, theirs: BaseException | None) -> None:
    if theirs is None:
        assert ours is None, f"ours raised {ours!r}, Flower's did not"
        return
    assert ours is not None, f"Flower's raised {theirs!r}, ours did not"
    assert type(ours) is type(theirs), f"ours raised {ours!r}, Flower's {theirs!r}"
