/**
 * A model's view in the main area, opened from the sidebar: per served version its state,
 * the same figures as the sidebar (one renderer, render.ts), the batch sizes the batcher
 * formed and the memory it holds, polled through ServerConnection while the tab is visible.
 */
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { IIndexEntry, IModelStats, field, modelPath, renderBatches, renderFigures, requestJSON } from './render';

const REFRESH_MS = 1000;

export class ModelView extends Widget {
  constructor(settings: ServerConnection.ISettings, model: string) {
    super();
    this._settings = settings;
    this.model = model;
    this.id = `jupyter-triton-model-${model}`;
    this.addClass('jp-TritonPanel');
    this.addClass('jp-TritonModelView');
    this.node.dataset.model = model;
    this.title.label = `Triton: ${model}`;
    this.title.closable = true;
    this.node.innerHTML = `
      <header class="jp-TritonPanel-header"></header>
      <div class="jp-TritonPanel-status" aria-live="polite"></div>
      <ul class="jp-TritonPanel-models"></ul>`;
    (this.node.querySelector('header') as HTMLElement).textContent = model;
    this._status = this.node.querySelector('.jp-TritonPanel-status') as HTMLElement;
    this._list = this.node.querySelector('ul') as HTMLElement;
    this._schedule(0);
  }

  readonly model: string;

  async refresh(): Promise<void> {
    try {
      const index = await requestJSON<IIndexEntry[]>(this._settings, 'v2/repository/index',
                                                     { method: 'POST', body: '{}' });
      const rows = index.filter(e => e.name === this.model);
      let stats: IModelStats[] = [];
      if (rows.some(r => r.state === 'READY')) {
        stats = (await requestJSON<{ model_stats: IModelStats[] }>(
          this._settings, `${modelPath(this.model)}/stats`, { method: 'GET' })).model_stats || [];
      }
      const byVersion = new Map(stats.map(s => [s.version, s]));
      this._list.replaceChildren(...rows.map(row => {
        const li = document.createElement('li');
        li.className = 'jp-TritonPanel-model';
        li.dataset.version = row.version ?? '';
        li.dataset.state = row.state ?? 'UNLOADED';
        const head = document.createElement('div');
        head.className = 'jp-TritonPanel-head';
        field(head, 'version', row.version ? `v${row.version}` : '');
        const state = row.state ?? 'UNLOADED';
        field(head, 'state', state).classList.add(`jp-TritonPanel-state-${state.toLowerCase()}`);
        li.appendChild(head);
        if (row.reason) {
          field(li, 'reason', row.reason);
        }
        const s = byVersion.get(row.version ?? '');
        if (s) {
          li.append(renderFigures(s), renderBatches(s));
        }
        return li;
      }));
      this._status.textContent = `updated ${new Date().toLocaleTimeString()}`;
      this._status.classList.remove('jp-TritonPanel-error');
      this.node.dataset.ticks = String(++this._ticks);
    } catch (err) {
      this._status.textContent = String(err instanceof Error ? err.message : err);
      this._status.classList.add('jp-TritonPanel-error');
    }
  }

  dispose(): void {
    if (this._timer !== undefined) {
      window.clearTimeout(this._timer);
      this._timer = undefined;
    }
    super.dispose();
  }

  private _schedule(delay: number): void {
    this._timer = window.setTimeout(async () => {
      if (this.isVisible) {
        await this.refresh();
      }
      if (!this.isDisposed) {
        this._schedule(REFRESH_MS);
      }
    }, delay);
  }

  private _settings: ServerConnection.ISettings;
  private _status: HTMLElement;
  private _list: HTMLElement;
  private _timer: number | undefined;
  private _ticks = 0;
}
