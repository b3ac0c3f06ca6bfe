"""What wakes watch's loop between passes before its interval ends: a change under a
local first tier, seen by watchdog (inotify on Linux) through :func:`observe`, when it is
one that can change what a pass decides (:func:`wakes`), never a read nor a change of the
watch's own files.

>>> from watchdog.events import FileCreatedEvent
>>> wakes(FileCreatedEvent("/hot/step-2/.metadata"))
True
"""
from __future__ import annotations

import os
import threading


def observe(url: str, wake: threading.Event, own: tuple[str, ...] = ()):
    """A started watchdog observer that sets ``wake`` when something changes under the
    local folder ``url`` (:func:`wakes`), never for the files or folders ``own`` (the
    watch's state folder, its metrics file); None (polling) for a remote URL or without
    watchdog.

    >>> observe("s3://bucket/run", threading.Event()) is None
    True
    """
    if "://" in url and not url.startswith("file://"):
        return None
    try:
        from watchdog.observers import Observer
    except ImportError:
        return None
    root = os.path.realpath(url.removeprefix("file://"))
    own = tuple(os.path.realpath(f) for f in own)
    os.makedirs(root, exist_ok=True)
    observer = Observer()
    observer.daemon = True
    handler = _Wake(wake, own)
    try:  # the filter also narrows the kernel's inotify mask: reads are never delivered
        observer.schedule(handler, root, recursive=True, event_filter=_wake_events())
    except TypeError:  # a watchdog without event_filter: the handler filters alone
        observer.schedule(handler, root, recursive=True)
    observer.start()
    return observer


def _wake_events() -> list[type]:
    """The watchdog events that can change what a pass decides: a file written and
    closed, anything created, moved or deleted, and lost events (the kernel's queue
    overflowed). Never a read: opened and closed-without-writing come from watch's own
    listing and verification, and waking on them made an idle watch spin. Nor a bare
    modification: a file still being written is closed later.

    >>> sorted(c.__name__ for c in _wake_events())[:3]
    ['DirCreatedEvent', 'DirDeletedEvent', 'DirMovedEvent']
    """
    from watchdog import events

    names = ("FileClosedEvent", "FileCreatedEvent", "DirCreatedEvent", "FileMovedEvent",
             "DirMovedEvent", "FileDeletedEvent", "DirDeletedEvent",
             "EventsLostEvent")  # watchdog >= 6
    return [getattr(events, n) for n in names if hasattr(events, n)]


def wakes(event, own: tuple[str, ...] = ()) -> bool:
    """Does watchdog's ``event`` wake the loop: one of :func:`_wake_events` about a path
    that is not one of ``own`` (a file, its temporary ``FILE.<suffix>``, or what lies
    under a folder), the files the watch itself rewrites every pass.

    >>> from watchdog.events import FileClosedEvent, FileClosedNoWriteEvent
    >>> wakes(FileClosedEvent("/hot/step-1/.metadata")), wakes(FileClosedNoWriteEvent("/hot/x"))
    (True, False)
    >>> wakes(FileClosedEvent("/hot/w.prom.12.34"), own=("/hot/w.prom",))
    False
    """
    if not isinstance(event, tuple(_wake_events())):
        return False
    paths = [os.fsdecode(p) for p in (event.src_path, getattr(event, "dest_path", ""))
             if p]
    return not paths or not all(_is_own(p, own) for p in paths)


def _is_own(path: str, own: tuple[str, ...]) -> bool:
    return any(path == o or path.startswith((o + ".", o + os.sep)) for o in own)


class _Wake:
    """The watchdog handler of :func:`observe`: sets ``wake`` on an event that
    :func:`wakes` it."""

    def __init__(self, wake: threading.Event, own: tuple[str, ...]):
        self.wake = wake
        self.own = own

    def dispatch(self, event) -> None:
        if wakes(event, self.own):
            self.wake.set()
