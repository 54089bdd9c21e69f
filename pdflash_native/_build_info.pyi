cuda_compiled: bool
cython_version: str

def summary() -> dict[str, object]: ...
