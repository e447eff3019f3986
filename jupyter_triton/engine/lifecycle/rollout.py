"""Promotion and rollback, the lifecycle's part: a version loaded staged, checked against a
golden set (engine/lifecycle/promotion.py), then served by a switch of the version policy; and the
previous version and config served again in one swap. Every switch is appended to the
model's history in the repository (repository/history.py)."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from ...config import CONFIG_FILENAME
from ...protocol.errors import InvalidArgument, NotFound, TritonError, Unavailable
from ...repository import PendingUpload
from ..model import READY, UNAVAILABLE, ModelVersion, VersionStatus
from ..observation.shadow import check as check_shadow
from .promotion import Promotion, compare, golden_request
from .table import Canary, Entry, ModelTable

if TYPE_CHECKING:
    from ...repository import Repository
    from ..options import EngineOptions

log = logging.getLogger(__name__)


def canary_running(name: str, entry: Entry) -> InvalidArgument:
    return InvalidArgument(f"model '{name}' has a canary running (version {entry.canary.version}): "
                           f"promote it ('golden' with 'promote': {entry.canary.version}) or stop "
                           f"it ('canary': 0) first")


class Rollout:
    """Promotions, canaries and rollbacks of the models in ``table``, and their history.
    Asks the lifecycle for a load of one model under its row's lock (``load``), a version
    built from the repository but not loaded (``build``), and the traffic tap's shadow
    report of a model (``shadow_report``)."""

    def __init__(self, table: ModelTable, repository: "Repository", options: "EngineOptions",
                 load: Callable[[str, Entry], Awaitable[None]],
                 build: Callable[[str, int], Awaitable[ModelVersion]],
                 shadow_report: Callable[[str], dict]) -> None:
        self.table = table
        self.repository = repository
        self.options = options
        self._load = load
        self._build = build
        self._shadow_report = shadow_report

    def history(self, name: str) -> list[dict]:
        """Which version served after each load, promotion, refusal and rollback."""
        return self.repository.lifecycle_history(name)

    def config_text(self, name: str) -> str | None:
        try:
            return (self.repository.model_dir(name) / CONFIG_FILENAME).read_text(encoding="utf-8")
        except (TritonError, OSError):
            return None

    def record(self, name: str, record: dict) -> None:
        try:
            self.repository.record_lifecycle(name, record)
        except (TritonError, OSError) as err:      # the swap happened; only its log is short
            log.error("model '%s': could not append to its lifecycle history: %s", name, err)

    async def promote(self, name: str, promotion: Promotion, config: str | None = None,
                      files: dict[str, bytes] | None = None) -> None:
        """Load the new version (an upload's, or ``promotion.version`` on disk) staged: not
        served, callable by explicit version; run the golden cases through it; only if every
        output matches, switch the version policy to it (new version READY before the old
        one retires). Otherwise the upload is set aside and InvalidArgument says, per case,
        what differed; what served keeps serving."""
        from ...repository import check_model_name
        check_model_name(name)
        if files and config is None:
            raise InvalidArgument(f"failed to load '{name}': load with files requires a 'config' parameter")
        if config is not None and not files:
            raise InvalidArgument(f"failed to promote '{name}': a config comes with the files "
                                  f"of the version it is for")
        if not files and promotion.version is None:
            raise InvalidArgument(f"failed to promote '{name}': give the new version's files, "
                                  f"or the version on disk to promote ('promote': <version>)")
        loop = asyncio.get_running_loop()
        entry = self.table.entry(name)
        async with entry.lock:
            before, before_config = entry.served(), await loop.run_in_executor(
                None, self.config_text, name)
            pending: PendingUpload | None = None
            canary = entry.canary if entry.canary is not None and not files and \
                promotion.version == entry.canary.version else None
            if entry.canary is not None and canary is None:
                raise canary_running(name, entry)
            if promotion.shadow_max_diff is not None:
                # before anything changes: refused, the version stays staged and shadowed
                try:
                    check_shadow(self._shadow_report(name)["shadow"], name,
                                 promotion.version, promotion.shadow_max_diff)
                except InvalidArgument as err:
                    await loop.run_in_executor(None, self.record, name, {
                        "action": "refused", "version": promotion.version, "served": before,
                        "reason": str(err)[:4000]})
                    raise
            entry.canary = None           # its requests go back to what served
            if canary is not None:
                pending = canary.pending
            elif files:
                pending = await loop.run_in_executor(
                    None, self.repository.stage_upload, name, config, dict(files))
            target = max(pending.versions) if pending is not None else promotion.version
            staged: ModelVersion | None = entry.staged.get(target) if canary is not None else None
            try:
                if staged is None:
                    staged = await self._stage(name, entry, target)
                diffs = []
                for i, case in enumerate(promotion.cases):
                    try:
                        response = await staged.infer(golden_request(name, target, case))
                        outputs = {t.name: t.data for t in response.outputs}
                        diff = compare(i, case, outputs, promotion.atol, promotion.rtol)
                    except TritonError as err:
                        diff = {"case": i, "error": str(err)}
                    if diff is not None:
                        diffs.append(diff)
                if diffs:
                    summary = json.dumps({"version": target, "cases": len(promotion.cases),
                                          "failed": diffs})
                    raise InvalidArgument(f"promotion of '{name}' version {target} refused: "
                                          f"its outputs differ from the golden set: {summary}")
                if pending is not None:
                    await asyncio.shield(loop.run_in_executor(None, pending.commit))
                else:
                    await loop.run_in_executor(None, self._serve_only, name, target)
                await self._load(name, entry)
                leftover = entry.staged.pop(target, None)    # its config changed: loaded anew
                if leftover is not None:
                    await leftover.unload(drain_seconds=self.options.unload_timeout_secs)
            except BaseException as err:
                if staged is not None and entry.staged.get(target) is staged:
                    entry.staged.pop(target)
                    await staged.unload(drain_seconds=self.options.unload_timeout_secs)
                if pending is not None:
                    await asyncio.shield(loop.run_in_executor(None, pending.abort, str(err)))
                elif promotion.version is not None and entry.served() != target:
                    await loop.run_in_executor(None, self._restore_config, name, before_config)
                if target is not None and target not in entry.serving:
                    entry.status[target] = VersionStatus(UNAVAILABLE, f"not promoted: {err}"[:2000])
                # a refused first upload leaves no model directory behind (its versions and
                # REASON.txt are under .failed/): no history file to keep one alive
                model_left = pending is None or not pending.created
                if isinstance(err, InvalidArgument) and "refused" in str(err) and model_left:
                    await loop.run_in_executor(None, self.record, name, {
                        "action": "refused", "version": target, "served": before,
                        "reason": str(err)[:4000]})
                raise
            self.table.want(name)
            await loop.run_in_executor(None, self.record, name, {
                "action": "promote", "version": entry.served(), "previous": before,
                "previous_config": before_config, "golden_cases": len(promotion.cases)})

    async def canary(self, name: str, fraction: float, config: str | None = None,
                     files: dict[str, bytes] | None = None) -> None:
        """Load an upload's version staged and send ``fraction`` of the requests that name no
        version to it, with its own statistics, until a promotion (``golden`` with
        ``promote: <its version>``) serves it or ``canary: 0`` stops it. Until then the upload
        is not committed: a restart serves what served before."""
        from ...repository import check_model_name
        check_model_name(name)
        loop = asyncio.get_running_loop()
        entry = self.table.entry(name)
        async with entry.lock:
            if fraction == 0 and not files:
                if entry.canary is None:
                    raise InvalidArgument(f"failed to stop the canary of '{name}': none is running")
                stopped = entry.canary
                await self.end_canary(entry, "canary stopped")
                await loop.run_in_executor(None, self.record, name, {
                    "action": "canary stopped", "version": stopped.version,
                    "served": entry.served()})
                return
            if not files or config is None:
                raise InvalidArgument(f"failed to start a canary of '{name}': it takes the new "
                                      f"version's config and files")
            if entry.canary is not None:
                raise canary_running(name, entry)
            if entry.served() is None:
                raise Unavailable(f"failed to start a canary of '{name}': no version of it is "
                                  f"served to compare with")
            pending = await loop.run_in_executor(
                None, self.repository.stage_upload, name, config, dict(files))
            target = max(pending.versions)
            try:
                await self._stage(name, entry, target)
            except BaseException as err:
                await asyncio.shield(loop.run_in_executor(None, pending.abort, str(err)))
                entry.status[target] = VersionStatus(UNAVAILABLE, f"canary failed to load: {err}"[:2000])
                raise
            # at fraction 0 a staged version: callable by explicit version, shadowed, promoted
            entry.canary = Canary(target, fraction, pending)
            entry.status[target] = VersionStatus(READY, f"canary: {fraction:g} of the requests"
                                                 if fraction else "staged: not served until promoted")
            await loop.run_in_executor(None, self.record, name, {
                "action": "canary" if fraction else "staged", "version": target,
                "served": entry.served(),
                "fraction": fraction})

    async def end_canary(self, entry: Entry, reason: str) -> None:
        canary, entry.canary = entry.canary, None
        if canary is None:
            return
        staged = entry.staged.pop(canary.version, None)
        if staged is not None:
            await staged.unload(drain_seconds=self.options.unload_timeout_secs)
        loop = asyncio.get_running_loop()
        await asyncio.shield(loop.run_in_executor(None, canary.pending.abort, reason))
        entry.status[canary.version] = VersionStatus(UNAVAILABLE, reason)

    async def _stage(self, name: str, entry: Entry, version: int) -> ModelVersion:
        loop = asyncio.get_running_loop()
        self.repository.model_dir(name)      # a model the repository lacks: its NotFound first
        if version not in await loop.run_in_executor(None, self.repository.versions_on_disk, name):
            raise NotFound(f"model '{name}' has no version {version} in the model repository")
        mv = await self._build(name, version)
        entry.status[version] = VersionStatus("LOADING", "staged for a golden check")
        await mv.load()
        entry.staged[version] = mv
        entry.status[version] = VersionStatus(READY, "staged: not served until promoted")
        return mv

    def _serve_only(self, name: str, version: int) -> None:
        # the replaced config goes to .history/; a newer version on disk releases the pin
        self.repository.pin_version(name, version, self.repository.read_config(name))

    def _restore_config(self, name: str, text: str | None) -> None:
        if text is not None and self.config_text(name) != text:
            from ...config import parse_config
            self.repository.write_config(name, parse_config(text, name, CONFIG_FILENAME))

    async def rollback(self, name: str) -> None:
        """Serve again the version that served before the current one, with the config it
        was served with (its version policy pinned to it), in one swap: it is READY before
        the current version retires."""
        entry = self.table.get(name)
        current = entry.served() if entry is not None else None
        if current is None:
            raise Unavailable(f"failed to roll back '{name}': no version of it is being served")
        if entry.canary is not None:
            raise canary_running(name, entry)
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(None, self.history, name)
        back = next((r for r in reversed(records) if r.get("action") in ("load", "promote", "rollback")
                     and r.get("version") == current and isinstance(r.get("previous"), int)), None)
        if back is None:
            raise InvalidArgument(f"failed to roll back '{name}': its history has no version "
                                  f"served before version {current}")
        previous, previous_config = back["previous"], back.get("previous_config")
        async with entry.lock:
            current_config = await loop.run_in_executor(None, self.config_text, name)
            if previous not in await loop.run_in_executor(None, self.repository.versions_on_disk, name):
                raise NotFound(f"failed to roll back '{name}': version {previous} is no longer in "
                               f"the model repository")

            def pin_previous() -> None:
                from ...config import parse_config
                config = (parse_config(previous_config, name, CONFIG_FILENAME) if previous_config
                          else self.repository.read_config(name))
                # until a newer version comes (an upload, one copied in): repository/pins.py
                self.repository.pin_version(name, previous, config)
            await loop.run_in_executor(None, pin_previous)
            try:
                await self._load(name, entry)
            except BaseException:
                await loop.run_in_executor(None, self._restore_config, name, current_config)
                raise
        await loop.run_in_executor(None, self.record, name, {
            "action": "rollback", "version": entry.served(), "previous": current,
            "previous_config": current_config})
