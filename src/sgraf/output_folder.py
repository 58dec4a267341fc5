"""Writing a generation of files into a folder that may hold an earlier one.

A data folder is read as a whole: `test_ims.npy` with `test_caps.txt`, `test_boxes.npy` and the
pictures under `images/test/`. Replacing some of these files and leaving the others would make
readers pair new features with old captions, boxes or pictures without a word. So a command
that writes such files (`sgraf generate`, `convert-tsv`, `extract`) does it through
`NewGeneration`:

- It holds the folder's lock (`sgraf.folder_lock`) while it works.
- It refuses, before any work, a folder that already holds files it would write or files an
  earlier sgraf generation wrote that are read together with them ("other data"), unless the
  caller passes `overwrite=True` (`--overwrite`). A whole-data-set writer (`exclusive=True`,
  `sgraf generate`) also counts files of the layout that sgraf did not write.
- The new files are written into a staging folder inside the folder. When all are written,
  the files of the earlier generation are removed first (those of the same names and those the
  new one does not write), then the new ones moved in: at no moment does the folder hold files
  of both. A failure or signal before that point leaves the folder as it was.
- sgraf only deletes or replaces files it wrote: the folder's record `.sgraf-files.json` lists
  them (name -> command). A file of the same family that sgraf did not write is never deleted
  or replaced, `--overwrite` or not; the command refuses and names it instead (unless the
  caller pairs it with the new files on purpose: captions kept beside converted features).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import stat
import tempfile
from typing import Callable, Iterable

from sgraf.atomic_write import ensure_folder, missing_folders, remove_empty_folders, write_error, write_text
from sgraf.errors import InputError
from sgraf.folder_lock import LOCK_FILE, FolderLock
from sgraf.io_paths import check_outputs
from sgraf.signals import signals_deferred

RECORD = ".sgraf-files.json"
DEMO_MARKER = ".sgraf-demo"      # at the top of a folder `sgraf demo` writes (`sgraf.demo`)
STAGING_PREFIX = ".sgraf-staging-"


def read_record(folder: pathlib.Path) -> dict[str, str]:
    """{relative path: command} of the files sgraf wrote into `folder` (empty if none)."""
    try:
        content = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        files = content["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def record_files(folder: pathlib.Path, names: Iterable[str], command: str) -> None:
    """Adds `names` (relative paths sgraf is about to write into `folder`) to its record, so that a
    later run may delete them; written before the files, so a crash never leaves a file of
    sgraf's that the record does not list."""
    record = read_record(folder)
    record.update({name: command for name in names})
    _write_record(folder, record)


def remove_recorded(folder: pathlib.Path, names: Iterable[str]) -> None:
    """Deletes the files `names` of `folder` (which the caller checked are sgraf's), drops them from
    the record and removes the folders they leave empty."""
    names = sorted(set(names))
    record = read_record(folder)
    for name in names:
        record.pop(name, None)
    try:
        with signals_deferred():
            _write_record(folder, record)
            for name in names:
                (folder / name).unlink(missing_ok=True)
            _remove_empty_folders(folder, {str(pathlib.PurePosixPath(n).parent) for n in names})
    except OSError as error:
        raise write_error(folder, error) from None


def _write_record(folder: pathlib.Path, files: dict[str, str]) -> None:
    content = {"format": "sgraf-files", "version": 1,
               "note": "files written by sgraf; only these are ever deleted by a later --overwrite",
               "files": dict(sorted(files.items()))}
    write_text(folder / RECORD, json.dumps(content, indent=1) + "\n")


def _own_name(name: str) -> bool:
    return name in (LOCK_FILE, RECORD) or name.startswith(STAGING_PREFIX)


def folder_files(folder: pathlib.Path) -> list[str]:
    """Relative posix paths of the files under `folder`, sgraf's lock, record and staging left out."""
    found = []
    for root, dirs, files in os.walk(folder):
        base = pathlib.Path(root)
        if base == folder:
            dirs[:] = [d for d in dirs if not _own_name(d)]
            files = [f for f in files if not _own_name(f)]
        found.extend((base / f).relative_to(folder).as_posix() for f in files)
    return sorted(found)


def _describe(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


class NewGeneration:
    """Writes one generation of files into `folder`; a context manager (see the module docstring).

    Inside the block, write each file at `generation.path(name)`; the generation moves them in
    when the block ends without error, and discards them otherwise.

    Args:
        folder: the output folder (created when missing).
        outputs: the relative paths the generation will write (checked before any work).
        family: which relative paths are read together with the outputs.
        command: the sgraf command, recorded for the files and named in errors.
        overwrite: the caller allows replacing other data (`--overwrite`).
        exclusive: every file of `family` already there is other data (a whole data set),
            not only the outputs' names and files of an earlier sgraf generation.
        earlier: files known to be sgraf's although the record does not list them (written
            by an sgraf from before the record, as its own metadata tells).
        paired: files of the family that the user may keep beside the new generation although
            sgraf did not write them (captions given apart from converted features).
        inputs: (label, path) of the files the command reads; none may be a file the generation
            writes or removes (`sgraf.io_paths.check_outputs`).

    Raises (on enter):
        InputError: `folder` is a file or holds other data (without `overwrite`), or holds a
            file of the family sgraf did not write that would stay beside the new ones, or an
            input is a file the generation would write or remove.
        FolderLockedError: another process writes the folder.
    """

    def __init__(self, folder: str | os.PathLike[str], outputs: Iterable[str], family: Callable[[str], bool],
                 command: str, overwrite: bool = False, exclusive: bool = False,
                 earlier: Iterable[str] = (), paired: Iterable[str] = (),
                 inputs: Iterable[tuple[str, str | os.PathLike[str] | None]] = ()) -> None:
        self.folder = pathlib.Path(folder)
        self.outputs = set(outputs)
        self.family = family
        self.command = command
        self.overwrite = overwrite
        self.exclusive = exclusive
        self.earlier = set(earlier)
        self.paired = set(paired)
        self.inputs = list(inputs)
        self.staging: pathlib.Path | None = None
        self._keep_staging = False
        self._lock = FolderLock(self.folder)
        self._created: list[pathlib.Path] = []

    def __enter__(self) -> "NewGeneration":
        self._created = missing_folders(self.folder)
        ensure_folder(self.folder)
        try:
            self._lock.acquire()
        except BaseException:
            remove_empty_folders(self._created)
            raise
        try:
            for leftover in self.folder.glob(STAGING_PREFIX + "*"):   # of a killed run: we hold the lock
                shutil.rmtree(leftover, ignore_errors=True)
            self._check_inputs()    # first: "an output is an input" says more than "not sgraf's"
            self._check()
            self.staging = pathlib.Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.folder))
        except OSError as error:
            self._release()
            raise write_error(self.folder, error) from None
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, *exc: object) -> None:
        committed = False
        try:
            if exc_type is None:
                self._commit()
                committed = True
            else:
                self._name_the_user_path(error)
        finally:
            if self.staging is not None and not self._keep_staging:
                shutil.rmtree(self.staging, ignore_errors=True)
            self._release(keep_folder=committed)

    def _release(self, keep_folder: bool = False) -> None:
        """The lock released and, unless the generation was moved in, the folders it made for it
        removed again where they are empty (a refused or failed command leaves none behind)."""
        self._lock.release()
        if not keep_folder:
            remove_empty_folders(self._created)

    def _name_the_user_path(self, error: BaseException | None) -> None:
        """Errors from inside the block name the folder's file, not the staging copy."""
        staging = str(self.staging)
        if isinstance(error, OSError):
            filename = str(error.filename or "")
            if filename.startswith(staging):
                raise write_error(self.folder / filename[len(staging) + 1:], error) from None
            if not filename:   # a write that failed without naming its file (ENOSPC from write())
                raise write_error(self.folder, error) from None
        if isinstance(error, InputError) and staging in str(error):
            raise InputError(str(error).replace(staging, str(self.folder))) from None

    def path(self, name: str) -> pathlib.Path:
        """Where to write the output `name` (a relative path) during the block."""
        if self.staging is None:
            raise RuntimeError("NewGeneration.path() outside its with-block")
        target = self.staging / name
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def _check(self) -> None:
        record = set(read_record(self.folder)) | self.earlier
        existing = [name for name in folder_files(self.folder) if self.family(name)]
        replaced = [name for name in existing if name in self.outputs and name not in record]
        if replaced:    # --overwrite replaces sgraf's files only: the user's own boxes or captions stay theirs
            raise InputError(f"{self.folder / replaced[0]} is not among the files sgraf recorded writing there "
                             f"({RECORD}), and sgraf {self.command} would replace it (--overwrite replaces only "
                             "those); move it away"
                             + (f" with the {len(replaced) - 1} other such files" if len(replaced) > 1 else "")
                             + ", or choose another folder")
        if self.exclusive:
            other = existing
        else:
            other = [name for name in existing if name in self.outputs or name in record]
        if other and not self.overwrite:
            raise InputError(f"{self.folder} already holds other data ({_describe(other)}); pass --overwrite "
                             f"to replace it with the output of sgraf {self.command}, or choose another folder")
        foreign = [name for name in existing if name not in self.outputs and name not in record
                   and name not in self.paired]
        if foreign:
            raise InputError(f"{self.folder / foreign[0]} was not written by sgraf and would stay beside the new "
                             f"output of sgraf {self.command} (sgraf deletes only files it wrote); move it away"
                             + (f" with the {len(foreign) - 1} other such files" if len(foreign) > 1 else ""))

    def _check_inputs(self) -> None:
        """No input may be a file this generation writes or removes."""
        record = set(read_record(self.folder)) | self.earlier
        existing = [name for name in folder_files(self.folder) if self.family(name)]
        removed = existing if self.exclusive else [name for name in existing if name in record]
        removed = removed if self.overwrite else []
        check_outputs(self.inputs, [("--out", self.folder / name) for name in sorted(self.outputs | set(removed))])

    def _commit(self) -> None:
        assert self.staging is not None
        written = folder_files(self.staging)
        on_disk = set(folder_files(self.folder))
        before = read_record(self.folder)
        # a generation killed mid-swap recorded files it had already removed: those names go
        record = {name: by for name, by in before.items() if name in on_disk or not self.family(name)}
        earlier = [name for name in folder_files(self.folder) if self.family(name)
                   and (name in written or name in record or name in self.earlier)]
        during = {**record, **{name: record.get(name, self.command) for name in earlier},
                  **{name: self.command for name in written}}
        for name in earlier:
            record.pop(name, None)
        record.update({name: self.command for name in written})
        current = self.folder / RECORD          # the user's path named if a step fails
        aside = self.staging / f"{STAGING_PREFIX}earlier"    # removed with the staging folder
        moved_aside: list[str] = []
        moved_in: list[str] = []
        replaced = set(earlier)
        try:
            with signals_deferred():                # a signal waits for the swap to end (SIGKILL does not):
                # the record names both generations while they swap, so that what a kill leaves there is
                # all sgraf's, and --overwrite again replaces it (naming only the new one had left the
                # earlier one's files there as files sgraf never wrote)
                _write_record(self.folder, during)
                for name in earlier:                # the earlier generation aside, then the new one in
                    current = self.folder / name
                    (aside / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(current, aside / name)
                    moved_aside.append(name)
                current = self.folder
                _remove_empty_folders(self.folder, {str(pathlib.PurePosixPath(n).parent) for n in earlier})
                for name in written:
                    current = self.folder / name
                    current.parent.mkdir(parents=True, exist_ok=True)
                    if name in replaced:            # the file it replaces keeps its permissions (0600 stays)
                        os.chmod(self.staging / name, stat.S_IMODE((aside / name).stat().st_mode))
                    os.replace(self.staging / name, current)
                    moved_in.append(name)
                current = self.folder / RECORD
                _write_record(self.folder, record)
        except OSError as error:
            # put the earlier generation back (it had been deleted file by file: a step that failed
            # midway, a file another program held open on Windows, lost the data set)
            self._put_back(moved_in, moved_aside, aside, before)
            raise write_error(current, error) from None

    def _put_back(self, moved_in: list[str], moved_aside: list[str], aside: pathlib.Path,
                  record: dict[str, str]) -> None:
        assert self.staging is not None
        try:
            for name in reversed(moved_in):
                os.replace(self.folder / name, self.staging / name)
            for name in reversed(moved_aside):
                (self.folder / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(aside / name, self.folder / name)
            _write_record(self.folder, record)
        except OSError as error:            # what is where now: said, and kept (not removed with the staging)
            self._keep_staging = True
            logging.getLogger(__name__).error(
                "%s: the earlier files could not all be put back (%s); those missing are in %s (move them back "
                "before the next write into the folder, which removes it)", self.folder, error.strerror or error,
                aside)


def _remove_empty_folders(folder: pathlib.Path, parents: set[str]) -> None:
    for parent in sorted(parents, key=len, reverse=True):
        path = folder / parent
        while path != folder and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
            path = path.parent
