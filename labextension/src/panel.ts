/**
 * The "Triton" sidebar: the models the jupyter_triton server extension serves, polled from
 * its v2 routes through ServerConnection, which carries Jupyter's token/cookie and XSRF.
 */
import { Clipboard } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

/** One row of POST v2/repository/index (state and reason absent for a model never loaded). */
export interface IIndexEntry {
  name: string;
  version?: string;
  state?: string;
  reason?: string;
}

interface IDuration {
  count: number;
  ns: number;
}

/** The part of one GET v2/models/stats entry the panel shows. */
export interface IModelStats {
  name: string;
  version: string;
  inference_count: number;
  execution_count: number;
  inference_stats: {
    success: IDuration;
    queue: IDuration;
    compute_input: IDuration;
    compute_infer: IDuration;
    compute_output: IDuration;
  };
}

const REFRESH_MS = 2000;

/** Mean of a Triton duration per request, '–' before the first request. */
function perRequestMs(ns: number, count: number): string {
  if (!count) {
    return '–';
  }
  const ms = ns / count / 1e6;
  return `${ms >= 100 ? ms.toFixed(0) : ms >= 1 ? ms.toFixed(2) : ms.toFixed(3)} ms`;
}

export class TritonPanel extends Widget {
  constructor(settings: ServerConnection.ISettings = ServerConnection.makeSettings()) {
    super();
    this._settings = settings;
    this.id = 'jupyter-triton-panel';
    this.addClass('jp-TritonPanel');
    this.title.caption = 'Triton';
    this.node.innerHTML = `
      <header class="jp-TritonPanel-header">Triton models</header>
      <div class="jp-TritonPanel-status" aria-live="polite"></div>
      <ul class="jp-TritonPanel-models"></ul>`;
    this._status = this.node.querySelector('.jp-TritonPanel-status') as HTMLElement;
    this._list = this.node.querySelector('ul') as HTMLElement;
    this._schedule(0);
  }

  /** Fetch the index and statistics once and redraw; errors are shown, never thrown. */
  async refresh(): Promise<void> {
    try {
      const [index, stats] = await Promise.all([
        this._request<IIndexEntry[]>('v2/repository/index', { method: 'POST', body: '{}' }),
        this._request<{ model_stats: IModelStats[] }>('v2/models/stats', { method: 'GET' })
      ]);
      this._render(index, stats.model_stats || []);
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

  protected onAfterShow(): void {
    void this.refresh();
  }

  private _schedule(delay: number): void {
    this._timer = window.setTimeout(async () => {
      // A collapsed sidebar costs the server nothing; the next tick after showing catches up.
      if (this.isVisible) {
        await this.refresh();
      }
      if (!this.isDisposed) {
        this._schedule(REFRESH_MS);
      }
    }, delay);
  }

  private async _request<T>(path: string, init: RequestInit): Promise<T> {
    const url = URLExt.join(this._settings.baseUrl, path);
    const response = await ServerConnection.makeRequest(url, init, this._settings);
    const text = await response.text();
    if (!response.ok) {
      let message: string;
      try {
        message = JSON.parse(text).error || text;
      } catch {
        // not JSON: Jupyter's own 404 page when the route does not exist, or a proxy's page
        message = response.status === 404
          ? 'the jupyter_triton server extension is not running on this Jupyter server'
          : response.statusText;
      }
      throw new Error(`${path}: ${response.status} ${message}`.slice(0, 300));
    }
    return JSON.parse(text) as T;
  }

  private _render(index: IIndexEntry[], stats: IModelStats[]): void {
    const byKey = new Map(stats.map(s => [`${s.name}/${s.version}`, s]));
    this._list.replaceChildren(
      ...index.map(entry => this._card(entry, byKey.get(`${entry.name}/${entry.version ?? ''}`)))
    );
    if (!index.length) {
      const empty = document.createElement('li');
      empty.className = 'jp-TritonPanel-empty';
      empty.textContent = 'The model repository is empty.';
      this._list.appendChild(empty);
    }
  }

  /** One model version: its figures as data attributes and classed fields, for tests too. */
  private _card(entry: IIndexEntry, stats?: IModelStats): HTMLLIElement {
    const li = document.createElement('li');
    const version = entry.version ?? '';
    const state = entry.state ?? 'UNLOADED';
    li.className = 'jp-TritonPanel-model';
    li.dataset.model = entry.name;
    li.dataset.version = version;
    li.dataset.state = state;
    const field = (parent: HTMLElement, cls: string, text: string): HTMLElement => {
      const span = document.createElement('span');
      span.className = `jp-TritonPanel-${cls}`;
      span.textContent = text;
      parent.appendChild(span);
      return span;
    };
    const head = document.createElement('div');
    head.className = 'jp-TritonPanel-head';
    field(head, 'name', entry.name);
    field(head, 'version', version ? `v${version}` : '');
    field(head, 'state', state).classList.add(`jp-TritonPanel-state-${state.toLowerCase()}`);
    li.appendChild(head);
    if (entry.reason) {
      field(li, 'reason', entry.reason);
    }
    if (stats) {
      const s = stats.inference_stats;
      const computeNs = s.compute_input.ns + s.compute_infer.ns + s.compute_output.ns;
      const figures = document.createElement('div');
      figures.className = 'jp-TritonPanel-figures';
      const figure = (label: string, cls: string, value: string, title: string): void => {
        const tile = document.createElement('div');
        tile.title = title;
        field(tile, 'label', label);
        field(tile, cls, value);
        figures.appendChild(tile);
      };
      figure('inferences', 'inferences', String(stats.inference_count), 'inference count');
      figure('executions', 'executions', String(stats.execution_count), 'execution count (batches run)');
      figure('queue', 'queue', perRequestMs(s.queue.ns, s.queue.count), 'average queue time per request');
      figure('compute', 'compute', perRequestMs(computeNs, s.compute_infer.count),
             'average compute time (input + infer + output) per request');
      li.appendChild(figures);
    }
    const url = URLExt.join(this._settings.baseUrl, 'v2/models', encodeURIComponent(entry.name));
    const link = document.createElement('div');
    link.className = 'jp-TritonPanel-link';
    field(link, 'url', url).title = url;
    const copy = document.createElement('button');
    copy.className = 'jp-TritonPanel-copy jp-mod-styled';
    copy.textContent = 'Copy';
    copy.title = 'Copy the model URL';
    copy.onclick = () => Clipboard.copyToSystem(url);
    link.appendChild(copy);
    li.appendChild(link);
    return li;
  }

  private _settings: ServerConnection.ISettings;
  private _status: HTMLElement;
  private _list: HTMLElement;
  private _timer: number | undefined;
  private _ticks = 0;
}
