from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepCache(_message.Message):
    __slots__ = ("policy", "threshold", "interval", "warmup", "order")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    policy: str
    threshold: float
    interval: int
    warmup: int
    order: int
    def __init__(self, policy: _Optional[str] = ..., threshold: _Optional[float] = ..., interval: _Optional[int] = ..., warmup: _Optional[int] = ..., order: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("transformer_forwards", "cached_forwards", "cache_policy", "input_tokens", "input_tokens_details", "output_tokens", "total_tokens")
    TRANSFORMER_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transformer_forwards: int
    cached_forwards: int
    cache_policy: str
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    total_tokens: int
    def __init__(self, transformer_forwards: _Optional[int] = ..., cached_forwards: _Optional[int] = ..., cache_policy: _Optional[str] = ..., input_tokens: _Optional[int] = ..., input_tokens_details: _Optional[_Union[InputTokensDetails, _Mapping]] = ..., output_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class InputTokensDetails(_message.Message):
    __slots__ = ("text_tokens", "image_tokens")
    TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text_tokens: int
    image_tokens: int
    def __init__(self, text_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ...) -> None: ...

class LoRARef(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "model", "n", "size", "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed", "lora", "cache", "output_format", "output_compression", "preview", "partial_images")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    model: str
    n: int
    size: str
    negative_prompt: str
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float
    seed: int
    lora: _containers.RepeatedCompositeFieldContainer[LoRARef]
    cache: StepCache
    output_format: str
    output_compression: int
    preview: bool
    partial_images: int
    def __init__(self, prompt: _Optional[str] = ..., model: _Optional[str] = ..., n: _Optional[int] = ..., size: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., true_cfg_scale: _Optional[float] = ..., seed: _Optional[int] = ..., lora: _Optional[_Iterable[_Union[LoRARef, _Mapping]]] = ..., cache: _Optional[_Union[StepCache, _Mapping]] = ..., output_format: _Optional[str] = ..., output_compression: _Optional[int] = ..., preview: _Optional[bool] = ..., partial_images: _Optional[int] = ...) -> None: ...

class EditImageRequest(_message.Message):
    __slots__ = ("image", "mask", "prompt", "model", "n", "size", "negative_prompt", "num_inference_steps", "guidance_scale", "true_cfg_scale", "seed", "strength", "lora", "cache", "output_format", "output_compression", "partial_images")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    image: _containers.RepeatedScalarFieldContainer[bytes]
    mask: bytes
    prompt: str
    model: str
    n: int
    size: str
    negative_prompt: str
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float
    seed: int
    strength: float
    lora: _containers.RepeatedCompositeFieldContainer[LoRARef]
    cache: StepCache
    output_format: str
    output_compression: int
    partial_images: int
    def __init__(self, image: _Optional[_Iterable[bytes]] = ..., mask: _Optional[bytes] = ..., prompt: _Optional[str] = ..., model: _Optional[str] = ..., n: _Optional[int] = ..., size: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., true_cfg_scale: _Optional[float] = ..., seed: _Optional[int] = ..., strength: _Optional[float] = ..., lora: _Optional[_Iterable[_Union[LoRARef, _Mapping]]] = ..., cache: _Optional[_Union[StepCache, _Mapping]] = ..., output_format: _Optional[str] = ..., output_compression: _Optional[int] = ..., partial_images: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("created", "images", "seed", "size", "replica", "usage", "output_format", "session_step")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SESSION_STEP_FIELD_NUMBER: _ClassVar[int]
    created: int
    images: _containers.RepeatedScalarFieldContainer[bytes]
    seed: int
    size: str
    replica: str
    usage: Usage
    output_format: str
    session_step: int
    def __init__(self, created: _Optional[int] = ..., images: _Optional[_Iterable[bytes]] = ..., seed: _Optional[int] = ..., size: _Optional[str] = ..., replica: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., output_format: _Optional[str] = ..., session_step: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "total", "preview")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    preview: bytes
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ..., preview: _Optional[bytes] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    result: GenerateResponse
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., result: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class CreateVideoRequest(_message.Message):
    __slots__ = ("prompt", "model", "size", "seconds", "num_frames", "fps", "num_inference_steps", "guidance_scale", "negative_prompt", "seed", "input_reference", "guidance_scale_2", "cache", "lora")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INPUT_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_2_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    model: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str
    seed: int
    input_reference: bytes
    guidance_scale_2: float
    cache: StepCache
    lora: _containers.RepeatedCompositeFieldContainer[LoRARef]
    def __init__(self, prompt: _Optional[str] = ..., model: _Optional[str] = ..., size: _Optional[str] = ..., seconds: _Optional[str] = ..., num_frames: _Optional[int] = ..., fps: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., negative_prompt: _Optional[str] = ..., seed: _Optional[int] = ..., input_reference: _Optional[bytes] = ..., guidance_scale_2: _Optional[float] = ..., cache: _Optional[_Union[StepCache, _Mapping]] = ..., lora: _Optional[_Iterable[_Union[LoRARef, _Mapping]]] = ...) -> None: ...

class VideoRef(_message.Message):
    __slots__ = ("id", "variant")
    ID_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    id: str
    variant: str
    def __init__(self, id: _Optional[str] = ..., variant: _Optional[str] = ...) -> None: ...

class ListVideosRequest(_message.Message):
    __slots__ = ("after", "limit", "order")
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    after: str
    limit: int
    order: str
    def __init__(self, after: _Optional[str] = ..., limit: _Optional[int] = ..., order: _Optional[str] = ...) -> None: ...

class VideoList(_message.Message):
    __slots__ = ("data", "first_id", "last_id", "has_more")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[VideoJob]
    first_id: str
    last_id: str
    has_more: bool
    def __init__(self, data: _Optional[_Iterable[_Union[VideoJob, _Mapping]]] = ..., first_id: _Optional[str] = ..., last_id: _Optional[str] = ..., has_more: _Optional[bool] = ...) -> None: ...

class RemixVideoRequest(_message.Message):
    __slots__ = ("id", "prompt")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ...) -> None: ...

class VideoJob(_message.Message):
    __slots__ = ("id", "object", "status", "progress", "created_at", "completed_at", "expires_at", "model", "size", "seconds", "num_frames", "prompt", "error", "deleted", "usage", "remixed_from_video_id", "fps", "error_code")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REMIXED_FROM_VIDEO_ID_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    status: str
    progress: int
    created_at: int
    completed_at: int
    expires_at: int
    model: str
    size: str
    seconds: str
    num_frames: int
    prompt: str
    error: str
    deleted: bool
    usage: Usage
    remixed_from_video_id: str
    fps: int
    error_code: str
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., status: _Optional[str] = ..., progress: _Optional[int] = ..., created_at: _Optional[int] = ..., completed_at: _Optional[int] = ..., expires_at: _Optional[int] = ..., model: _Optional[str] = ..., size: _Optional[str] = ..., seconds: _Optional[str] = ..., num_frames: _Optional[int] = ..., prompt: _Optional[str] = ..., error: _Optional[str] = ..., deleted: _Optional[bool] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., remixed_from_video_id: _Optional[str] = ..., fps: _Optional[int] = ..., error_code: _Optional[str] = ...) -> None: ...

class VideoContent(_message.Message):
    __slots__ = ("id", "mp4", "media_type", "image")
    ID_FIELD_NUMBER: _ClassVar[int]
    MP4_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    mp4: bytes
    media_type: str
    image: bytes
    def __init__(self, id: _Optional[str] = ..., mp4: _Optional[bytes] = ..., media_type: _Optional[str] = ..., image: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("size", "model")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    size: str
    model: str
    def __init__(self, size: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "size", "closed")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    id: str
    size: str
    closed: bool
    def __init__(self, id: _Optional[str] = ..., size: _Optional[str] = ..., closed: _Optional[bool] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SessionGenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "strength", "num_inference_steps", "guidance_scale", "seed", "preview", "cache", "negative_prompt", "true_cfg_scale", "lora")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TRUE_CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: str
    strength: float
    num_inference_steps: int
    guidance_scale: float
    seed: int
    preview: bool
    cache: StepCache
    negative_prompt: str
    true_cfg_scale: float
    lora: _containers.RepeatedCompositeFieldContainer[LoRARef]
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[str] = ..., strength: _Optional[float] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., preview: _Optional[bool] = ..., cache: _Optional[_Union[StepCache, _Mapping]] = ..., negative_prompt: _Optional[str] = ..., true_cfg_scale: _Optional[float] = ..., lora: _Optional[_Iterable[_Union[LoRARef, _Mapping]]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "kind", "created")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    created: int
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., created: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, data: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("replica_id", "health", "device", "control_version", "layout", "details")
    class LayoutEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    health: str
    device: str
    control_version: int
    layout: _containers.ScalarMap[str, int]
    details: _struct_pb2.Struct
    def __init__(self, replica_id: _Optional[str] = ..., health: _Optional[str] = ..., device: _Optional[str] = ..., control_version: _Optional[int] = ..., layout: _Optional[_Mapping[str, int]] = ..., details: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("data", "expected", "desired_version")
    DATA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_VERSION_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Replica]
    expected: int
    desired_version: int
    def __init__(self, data: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., expected: _Optional[int] = ..., desired_version: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: str
    def __init__(self, status: _Optional[str] = ...) -> None: ...

class LoadLoRARequest(_message.Message):
    __slots__ = ("name", "path", "scale", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    scale: float
    target: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., scale: _Optional[float] = ..., target: _Optional[str] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoRAInfo(_message.Message):
    __slots__ = ("name", "path", "scale", "target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    scale: float
    target: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., scale: _Optional[float] = ..., target: _Optional[str] = ...) -> None: ...

class ListLoRAsResponse(_message.Message):
    __slots__ = ("data", "version")
    DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[LoRAInfo]
    version: int
    def __init__(self, data: _Optional[_Iterable[_Union[LoRAInfo, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class AdminReply(_message.Message):
    __slots__ = ("version", "replicas", "missing")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    version: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    missing: int
    def __init__(self, version: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ..., missing: _Optional[int] = ...) -> None: ...
