"""Two threads of one process writing the same file at once (found by bench/fault_injection.py: both agents shipped
the manifest together and the head answered one of them 500, its rename having found nothing to rename)."""

from __future__ import annotations

import threading

from ranksight.layout import atomic_write


def test_concurrent_atomic_writes_of_one_file_from_threads(tmp_path):
    path = tmp_path / "run.json"
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def writer(k: int) -> None:
        start.wait()
        for i in range(400):
            try:
                atomic_write(path, f'{{"writer": {k}, "i": {i}}}'.encode(), durable=False)
            except OSError as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes().startswith(b'{"writer": ')  # one whole write, never a torn one
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left behind
