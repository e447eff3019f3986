/**
 * A model's dashboard in the main area, opened from the sidebar: its served versions with
 * their state and memory, and below them the notebook dashboard widget's own rendering
 * (jupyter_triton/widgets/dashboard.js: throughput, queue and compute per request, pending,
 * failures, batch sizes formed), fed through ServerConnection instead of a kernel.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';
import dashboard, { IWidgetModel } from 'jupyter-triton-dashboard';

import { IIndexEntry, IModelStats, field, memoryText, modelPath, requestJSON } from './render';

const REFRESH_MS = 1000;

/**
 * The traits the renderer reads of its anywidget model, fixed: this model, polled by the
 * browser (no kernel here, so no snapshot and nothing listens to browser_polling).
 */
function viewModel(name: string, intervalS: number): IWidgetModel {
  const values = new Map<string, unknown>([
    ['model', name],
    ['interval', intervalS],
    ['server_path', ''],
    ['snapshot', {}],
    ['error', ''],
    ['browser_polling', false],
    ['tab', 'stats'],     // its logs tab reads v2/models/{m}/logs through ServerConnection too
    ['logs', []]
  ]);
  return {
    get: key => values.get(key),
    set: (key, value) => void values.set(key, value),
    save_changes: () => undefined,
    on: () => undefined,
    off: () => undefined
  };
}

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
      <ul class="jp-TritonPanel-models"></ul>
      <div class="jp-TritonModelView-dashboard"></div>`;
    (this.node.querySelector('header') as HTMLElement).textContent = model;
    this._status = this.node.querySelector('.jp-TritonPanel-status') as HTMLElement;
    this._list = this.node.querySelector('ul') as HTMLElement;
    this._host = this.node.querySelector('.jp-TritonModelView-dashboard') as HTMLElement;
    this._unmount = dashboard.render({
      model: viewModel(model, REFRESH_MS / 1000),
      el: this._host,
      request: (path: string) => this._request(path)
    });
    this._schedule(0);
  }

  readonly model: string;

  async refresh(): Promise<void> {
    try {
      // every model's statistics: they cannot fail between an index that says READY and an unload
      const [index, all] = await Promise.all([
        requestJSON<IIndexEntry[]>(this._settings, 'v2/repository/index', { method: 'POST', body: '{}' }),
        requestJSON<{ model_stats: IModelStats[] }>(this._settings, 'v2/models/stats', { method: 'GET' })
      ]);
      const rows = index.filter(e => e.name === this.model);
      const stats = (all.model_stats || []).filter(s => s.name === this.model);
      const byVersion = new Map(stats.map(s => [s.version, s]));
      this._list.replaceChildren(...rows.map(row => {
        const li = document.createElement('li');
        li.className = 'jp-TritonPanel-model';
        li.dataset.version = row.version ?? '';
        const state = row.state ?? 'UNLOADED';
        li.dataset.state = state;
        const head = document.createElement('div');
        head.className = 'jp-TritonPanel-head';
        field(head, 'version', row.version ? `v${row.version}` : '');
        field(head, 'state', state).classList.add(`jp-TritonPanel-state-${state.toLowerCase()}`);
        const s = byVersion.get(row.version ?? '');
        if (s) {
          field(head, 'memory', memoryText(s.memory_usage)).title =
            "what the version holds (Triton's memory_usage statistics)";
        }
        li.appendChild(head);
        if (row.reason) {
          field(li, 'reason', row.reason).dataset.reason = row.reason;
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
    this._unmount();
    super.dispose();
  }

  /** How the shared renderer reaches the server: ServerConnection, while the tab is shown. */
  private async _request(path: string): Promise<Response> {
    // a tab in the background holds the renderer's loop instead of polling the server
    while (!this.isVisible && !this.isDisposed) {
      await new Promise(resolve => window.setTimeout(resolve, REFRESH_MS));
    }
    const get = (p: string) =>
      ServerConnection.makeRequest(URLExt.join(this._settings.baseUrl, p),
                                   { method: 'GET', cache: 'no-store' }, this._settings);
    if (path !== `${modelPath(this.model)}/stats`) {
      return get(path);
    }
    // Triton answers 400 for the statistics of a model with no version loaded, and the
    // renderer gives up after three failures; every model's statistics, filtered, are empty
    // then instead, so the view picks the model up again once it is loaded again.
    const response = await get('v2/models/stats');
    if (!response.ok) {
      return response;
    }
    const all = ((await response.json()).model_stats || []) as IModelStats[];
    return new Response(JSON.stringify({ model_stats: all.filter(s => s.name === this.model) }),
                        { status: 200, headers: { 'Content-Type': 'application/json' } });
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
  private _host: HTMLElement;
  private _unmount: () => void;
  private _timer: number | undefined;
  private _ticks = 0;
}
