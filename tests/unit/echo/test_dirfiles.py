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
    assert sorted(files) == ["config.json", "model.safetensors"] and dirfiles.size(d) == 2 + 256_000
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
