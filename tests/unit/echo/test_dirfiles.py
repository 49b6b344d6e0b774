"""A model directory as it travels: one digest whether read from disk or received as files, and
no file name that would write outside the cache."""

import pytest

from echo import dirfiles


def test_a_directory_digests_the_same_on_disk_and_as_files_and_a_changed_byte_changes_it(tmp_path):
    d = tmp_path / "opponent"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 1000)
    (d / ".cache").mkdir()  # what is not a top-level plain file is not part of it
    (d / ".lock").write_text("x")
    files = dirfiles.read(d)
    assert sorted(files) == ["config.json", "model.safetensors"] and dirfiles.Packed(dirfiles.listed(d)).files_size == 2 + 256_000
    assert dirfiles.digest(d) == dirfiles.files_digest(files)
    copy = dirfiles.write(files, tmp_path / "cache", "opponent_model")
    assert copy.name.startswith("opponent_model-") and dirfiles.digest(copy) == dirfiles.digest(d)
    assert dirfiles.write(files, tmp_path / "cache", "opponent_model") == copy  # the same files: the same directory
    (copy / "config.json").write_text('{"x": 1}')
    assert dirfiles.digest(copy) != dirfiles.digest(d)
    # Name and content are kept apart: moving bytes between a name and its file changes the digest.
    assert dirfiles.files_digest({"ab": b"c"}) != dirfiles.files_digest({"a": b"bc"})


@pytest.mark.parametrize("name", ["../x", "a/b", ".bashrc", "", "a\\b", "a\0b"])
def test_a_file_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="refusing file name"):
        dirfiles.write({"config.json": b"{}", name: b"x"}, tmp_path, "opponent_model")
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("sizes", [[0, 1, 255], [256, 65535, 65536, 300_000], [3] * 17])  # each bin and map header
def test_a_directory_packed_a_chunk_at_a_time_is_what_msgpack_packs_of_it_whole(tmp_path, sizes):
    import msgpack

    for i, n in enumerate(sizes):
        (tmp_path / f"f{i:02d}.bin").write_bytes(bytes([i]) * n)
    packed = dirfiles.Packed(dirfiles.listed(tmp_path))
    pieces = list(packed.chunks())
    assert max(map(len, pieces)) <= dirfiles.CHUNK
    whole = msgpack.packb(dirfiles.read(tmp_path), use_bin_type=True)
    assert b"".join(pieces) == whole and packed.size == len(whole)


def test_a_file_that_shrinks_while_it_is_packed_is_an_error_not_a_short_file(tmp_path):
    (tmp_path / "a.bin").write_bytes(bytes(3 * dirfiles.CHUNK))
    pieces = dirfiles.Packed(dirfiles.listed(tmp_path)).chunks()
    next(pieces), next(pieces), next(pieces)  # map header, file header, first chunk
    (tmp_path / "a.bin").write_bytes(bytes(10))
    with pytest.raises(OSError, match="shrank"):
        list(pieces)
