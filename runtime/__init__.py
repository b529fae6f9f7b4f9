"""ipuserve.runtime: Graphcore's Model Runtime, re-implemented in Python on simulated IPUs.

Use it as the spec's listings use ``model_runtime``::

    import ipuserve.runtime as model_runtime
    from ipuserve.runtime import popef

Names, including their camelCase, follow the real library on purpose (API
compatibility); see docs/runtime.md for what is simulated and how.

Beyond the spec's names this exports what a server built on the runtime needs (the
worker imports nothing else, tests/test_layout.py checks it): the batch policies
(``BatchPolicy``, ``make_policy``), a model's execute inputs and outputs
(``IoPlan``, ``batch_dims``) and the simulated host (``SimulatorConfig``,
``IPUS_ENV``, ``holders``).
"""

from ipuserve.logs import apply_env_level as _apply_env_level
from ipuserve.runtime.devices import (
    Device,
    DeviceConstraints,
    DeviceManager,
    DeviceWaitConfig,
    DeviceWaitStrategy,
)
from ipuserve.runtime.memory import IMemoryPool, RingMemoryPool, allocateQueueStorage
from ipuserve.runtime.model_runner.batch_policy import BatchPolicy, make_policy
from ipuserve.runtime.model_runner.config import (
    BATCHING_DIM_DISABLED,
    NANOSECONDS_MAX,
    FlushCallback,
    ModelRunnerConfig,
)
from ipuserve.runtime.model_runner.futures import OutputFuture
from ipuserve.runtime.model_runner.io_plan import IoPlan, batch_dims
from ipuserve.runtime.model_runner.memory import (
    DataDesc,
    InputDesc,
    InputMemoryView,
    OutputDesc,
    OutputMemory,
    OutputMemoryView,
    ReplicaIdToOutputMemoryView,
    TensorResult,
)
from ipuserve.runtime.model_runner.runner import ModelRunner, PopefPaths
from ipuserve.runtime.predicates import (
    AnchorCallbackPolicy,
    AnchorCallbackPredicate,
    AnchorWithPolicy,
    PopefDataUsagePolicy,
    PopefDataUsagePredicate,
    ProgramsWithPolicy,
    anchor_callbacks,
    null_anchor_callback_predicate,
    null_popef_data_usage_predicate,
    popef_data_usage,
    predicate_factory,
    ring_size_multiplier_factory,
)
from ipuserve.runtime.queue_manager import QueueManager, RingSizeMultiplierProdType
from ipuserve.runtime.queues import (
    InputData,
    InputQueue,
    IQueue,
    OutputData,
    OutputQueue,
    ReadCompleteCallback,
    ReadStartCallback,
    WriteCompleteCallback,
)
from ipuserve.runtime.ring_buffer import InputRingBuffer, OutputRingBuffer, SpscRingBuffer
from ipuserve.runtime.session import (
    CallbackFactory,
    CallbackHandle,
    CallbackInfo,
    LaunchPolicy,
    Session,
    SessionConfig,
)
from ipuserve.runtime.simulator.config import IPUS_ENV, SimulatorConfig
from ipuserve.runtime.simulator.inventory import holders

__all__ = [
    "BATCHING_DIM_DISABLED",
    "IPUS_ENV",
    "NANOSECONDS_MAX",
    "AnchorCallbackPolicy",
    "AnchorCallbackPredicate",
    "AnchorWithPolicy",
    "BatchPolicy",
    "CallbackFactory",
    "CallbackHandle",
    "CallbackInfo",
    "DataDesc",
    "Device",
    "DeviceConstraints",
    "DeviceManager",
    "DeviceWaitConfig",
    "DeviceWaitStrategy",
    "FlushCallback",
    "IMemoryPool",
    "IQueue",
    "InputData",
    "InputDesc",
    "InputMemoryView",
    "InputQueue",
    "InputRingBuffer",
    "IoPlan",
    "LaunchPolicy",
    "ModelRunner",
    "ModelRunnerConfig",
    "OutputData",
    "OutputDesc",
    "OutputFuture",
    "OutputMemory",
    "OutputMemoryView",
    "OutputQueue",
    "OutputRingBuffer",
    "PopefDataUsagePolicy",
    "PopefDataUsagePredicate",
    "PopefPaths",
    "ProgramsWithPolicy",
    "QueueManager",
    "ReadCompleteCallback",
    "ReadStartCallback",
    "ReplicaIdToOutputMemoryView",
    "RingMemoryPool",
    "RingSizeMultiplierProdType",
    "Session",
    "SessionConfig",
    "SimulatorConfig",
    "SpscRingBuffer",
    "TensorResult",
    "WriteCompleteCallback",
    "allocateQueueStorage",
    "anchor_callbacks",
    "batch_dims",
    "holders",
    "make_policy",
    "null_anchor_callback_predicate",
    "null_popef_data_usage_predicate",
    "popef_data_usage",
    "predicate_factory",
    "ring_size_multiplier_factory",
]

_apply_env_level()
