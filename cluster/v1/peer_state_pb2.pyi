from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("prefix", "rank", "step", "any_rank", "nonce", "proof")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ANY_RANK_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    rank: int
    step: int
    any_rank: bool
    nonce: bytes
    proof: bytes
    def __init__(self, prefix: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., any_rank: _Optional[bool] = ..., nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("file_bytes", "data")
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file_bytes: int
    data: bytes
    def __init__(self, file_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
