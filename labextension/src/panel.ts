/**
 * The "Triton" sidebar: the models the jupyter_triton server extension serves, polled from
 * its v2 routes, and what a user does with them: load, unload, choose the served versions
 * (a config override of version_policy through the repository API, as Triton's clients send
 * it), view the config, open a model's view in the main area, copy its URL or a
 * tritonclient snippet. Every action is an ordinary v2 call through ServerConnection.
 */
import { Clipboard } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';
import { figures } from 'jupyter-triton-dashboard';

import {
  IEnsembleStep,
  IIndexEntry,
  IModelStats,
  field,
  modelPath,
  renderFigures,
  renderSteps,
  requestJSON,
  tritonclientSnippet
} from './render';

export { IIndexEntry, IModelStats } from './render';

const REFRESH_MS = 2000;

export interface IPanelOptions {
  /** Open the model's view in the main area (the plugin wires it to the shell). */
  openDashboard?: (name: string) => void;
}

/** Triton's version_policy for a choice of the versions menu. */
function versionPolicy(choice: string): Record<string, unknown> {
  if (choice === 'all') {
    return { all: {} };
  }
  if (choice === 'latest') {
    return { latest: { num_versions: 1 } };
  }
  return { specific: { versions: [Number(choice.replace(/^v/, ''))] } };
}

export class TritonPanel extends Widget {
  constructor(
    settings: ServerConnection.ISettings = ServerConnection.makeSettings(),
    options: IPanelOptions = {}
  ) {
    super();
    this._settings = settings;
    this._options = options;
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
      // rates between two readings, computed as the notebook dashboard computes them
      const snapshot = { t: Date.now() / 1000, model_stats: stats.model_stats || [] };
      this._rates = new Map(this._snapshot
        ? figures(this._snapshot, snapshot).map(f => [f.key, f.infPerS]) : []);
      this._snapshot = snapshot;
      await this._readSteps(index);
      // an open versions menu would close under the user's pointer: redraw on the next tick
      const active = document.activeElement;
      if (!(active instanceof HTMLSelectElement && this.node.contains(active))) {
        this._render(index, stats.model_stats || []);
      }
      if (!this._busy) {
        // a failed action's reason stays until the next action: a redraw must not hide it
        const updated = `updated ${new Date().toLocaleTimeString()}`;
        this._setStatus(this._failed ? `${this._failed} (${updated})` : updated, !!this._failed);
      }
      this.node.dataset.ticks = String(++this._ticks);
    } catch (err) {
      this._setStatus(String(err instanceof Error ? err.message : err), true);
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

  private _request<T>(path: string, init: RequestInit): Promise<T> {
    return requestJSON<T>(this._settings, path, init);
  }

  private _setStatus(text: string, error: boolean): void {
    this._status.textContent = text;
    this._status.classList.toggle('jp-TritonPanel-error', error);
  }

  /** One action at a time: its progress and its error in the status line, then a redraw. */
  private async _act(what: string, action: () => Promise<void>): Promise<void> {
    if (this._busy) {
      return;
    }
    this._busy = true;
    this._failed = null;
    this.node.dataset.busy = what;
    this._setStatus(`${what}…`, false);
    try {
      await action();
      this._busy = false;
      await this.refresh();
      this._setStatus(`${what}: done`, false);
    } catch (err) {
      this._busy = false;
      this._failed = `${what}: ${err instanceof Error ? err.message : err}`;
      this._setStatus(this._failed, true);
    } finally {
      delete this.node.dataset.busy;
    }
  }

  private _repository(name: string, verb: 'load' | 'unload', body: unknown = {}): Promise<void> {
    return this._request<void>(`v2/repository/models/${encodeURIComponent(name)}/${verb}`, {
      method: 'POST',
      body: JSON.stringify(body)
    });
  }

  /** Serve the versions chosen: the model's config with another version_policy, loaded. */
  private async _setVersions(name: string, choice: string): Promise<void> {
    const config = await this._request<Record<string, unknown>>(`${modelPath(name)}/config`, {
      method: 'GET'
    });
    config.version_policy = versionPolicy(choice);
    await this._repository(name, 'load', { parameters: { config: JSON.stringify(config) } });
  }

  private async _toggleConfig(key: string, name: string, version: string): Promise<void> {
    if (this._configs.has(key)) {
      this._configs.delete(key);
      return;
    }
    const path = version ? `${modelPath(name)}/versions/${version}/config` : `${modelPath(name)}/config`;
    const config = await this._request<unknown>(path, { method: 'GET' });
    this._configs.set(key, JSON.stringify(config, null, 2));
  }

  /**
   * Which ready versions are ensembles, and their steps, from their configs: read once per
   * version (a re-run ensemble is a new version), so a refresh costs no more calls after.
   */
  private async _readSteps(index: IIndexEntry[]): Promise<void> {
    const unread = index.filter(e => e.version && e.state === 'READY' && !this._steps.has(`${e.name}/${e.version}`));
    await Promise.all(unread.map(async e => {
      try {
        const config = await this._request<{ platform?: string; ensemble_scheduling?: { step?: IEnsembleStep[] } }>(
          `${modelPath(e.name)}/versions/${encodeURIComponent(e.version as string)}/config`, { method: 'GET' });
        this._steps.set(`${e.name}/${e.version}`,
                        config.platform === 'ensemble' ? config.ensemble_scheduling?.step || [] : null);
      } catch {
        // unloaded meanwhile: read again once it is ready
      }
    }));
  }

  private _render(index: IIndexEntry[], stats: IModelStats[]): void {
    const byKey = new Map(stats.map(s => [`${s.name}/${s.version}`, s]));
    const versions = new Map<string, IIndexEntry[]>();      // a model's rows that name a version
    for (const entry of index) {
      if (entry.version) {
        versions.set(entry.name, [...(versions.get(entry.name) || []), entry]);
      }
    }
    this._list.replaceChildren(
      ...index.map(entry =>
        this._card(entry, byKey.get(`${entry.name}/${entry.version ?? ''}`), versions.get(entry.name) || [])
      )
    );
    if (!index.length) {
      const empty = document.createElement('li');
      empty.className = 'jp-TritonPanel-empty';
      empty.textContent = 'The model repository is empty.';
      this._list.appendChild(empty);
    }
  }

  /** One model version: its figures as data attributes and classed fields, for tests too. */
  private _card(entry: IIndexEntry, stats: IModelStats | undefined, versions: IIndexEntry[]): HTMLLIElement {
    const li = document.createElement('li');
    const name = entry.name;
    const version = entry.version ?? '';
    const state = entry.state ?? 'UNLOADED';
    const key = `${name}/${version}`;
    li.className = 'jp-TritonPanel-model';
    li.dataset.model = name;
    li.dataset.version = version;
    li.dataset.state = state;
    // within a residency budget the server evicts idle models (they load again on a request):
    // resident and evicted are told apart, an evicted model is not a broken one
    const evicted = state === 'UNAVAILABLE' && (entry.reason ?? '').startsWith('evicted');
    li.dataset.residency = state === 'READY' ? 'resident' : evicted ? 'evicted' : '';
    const shown = evicted ? 'EVICTED' : state;
    const head = document.createElement('div');
    head.className = 'jp-TritonPanel-head';
    field(head, 'name', name);
    field(head, 'version', version ? `v${version}` : '');
    const badge = field(head, 'state', shown);
    badge.classList.add(`jp-TritonPanel-state-${shown.toLowerCase()}`);
    if (evicted) {
      badge.title = 'evicted to stay within the residency budget: the next request loads it again';
    }
    li.appendChild(head);
    if (entry.reason) {
      field(li, 'reason', entry.reason).dataset.reason = entry.reason;
    }
    if (stats) {
      li.appendChild(renderFigures(stats, this._rates.get(key) ?? null));
    }
    const steps = this._steps.get(key);
    if (steps) {
      li.dataset.ensemble = 'true';
      li.appendChild(renderSteps(steps, stats));
    }
    li.appendChild(this._actions(name, version, state, key, versions));
    const config = this._configs.get(key);
    if (config !== undefined) {
      const pre = document.createElement('pre');
      pre.className = 'jp-TritonPanel-config';
      pre.textContent = config;
      li.appendChild(pre);
    }
    const url = URLExt.join(this._settings.baseUrl, 'v2/models', encodeURIComponent(name));
    const link = document.createElement('div');
    link.className = 'jp-TritonPanel-link';
    field(link, 'url', url).title = url;
    const copy = this._button('Copy', 'copy', 'Copy the model URL', () => Clipboard.copyToSystem(url));
    copy.classList.add('jp-TritonPanel-copy');
    link.appendChild(copy);
    const snippet = tritonclientSnippet(this._settings, name);
    const code = this._button('Snippet', 'snippet', 'Copy a tritonclient snippet that calls this model',
                              () => Clipboard.copyToSystem(snippet));
    code.dataset.snippet = snippet;
    link.appendChild(code);
    li.appendChild(link);
    return li;
  }

  private _actions(name: string, version: string, state: string, key: string,
                   versions: IIndexEntry[]): HTMLElement {
    const bar = document.createElement('div');
    bar.className = 'jp-TritonPanel-actions';
    const ready = state === 'READY';
    const load = this._button(ready ? 'Reload' : 'Load', 'load', 'Load the model from the repository',
      () => this._act(`loading ${name}`, () => this._repository(name, 'load')));
    const unload = this._button('Unload', 'unload', 'Unload every version of the model',
      () => this._act(`unloading ${name}`, () => this._repository(name, 'unload')));
    unload.disabled = !ready;
    const menu = document.createElement('select');
    menu.className = 'jp-TritonPanel-policy';
    menu.dataset.action = 'versions';
    menu.title = 'Which versions the server serves (version_policy)';
    // the placeholder says what is served now, the choices what could be
    const serving = versions.filter(v => v.state === 'READY').map(v => `v${v.version}`);
    const choices = [['', serving.length ? `serving ${serving.join(', ')}` : 'versions…'],
                     ['latest', 'latest'], ['all', 'all'],
                     ...versions.map(v => [`v${v.version}`, `only v${v.version}`])];
    for (const [value, label] of choices) {
      const option = document.createElement('option');
      option.value = value;
      option.textContent = label;
      menu.appendChild(option);
    }
    menu.disabled = !ready;
    menu.onchange = () => {
      const choice = menu.value;
      if (choice) {
        void this._act(`serving ${choice} of ${name}`, () => this._setVersions(name, choice));
      }
    };
    const config = this._button(this._configs.has(key) ? 'Hide config' : 'Config', 'config',
      "The model's config (GET v2/models/<name>/config)",
      () => this._act(`config of ${name}`, () => this._toggleConfig(key, name, version)));
    config.disabled = !ready && !this._configs.has(key);     // a shown config can always be hidden
    bar.append(load, unload, menu, config);
    if (this._options.openDashboard) {
      const open = this._options.openDashboard;
      bar.appendChild(this._button('Dashboard', 'dashboard', "Open the model's view in the main area",
                                   () => open(name)));
    }
    return bar;
  }

  private _button(label: string, action: string, title: string, onclick: () => unknown): HTMLButtonElement {
    const button = document.createElement('button');
    button.className = 'jp-mod-styled jp-TritonPanel-button';
    button.dataset.action = action;
    button.textContent = label;
    button.title = title;
    button.onclick = () => void onclick();
    return button;
  }

  private _settings: ServerConnection.ISettings;
  private _options: IPanelOptions;
  private _status: HTMLElement;
  private _list: HTMLElement;
  private _timer: number | undefined;
  private _ticks = 0;
  private _busy = false;
  private _failed: string | null = null;
  private _configs = new Map<string, string>();
  private _snapshot: { t: number; model_stats: IModelStats[] } | null = null;
  private _rates = new Map<string, number>();
  private _steps = new Map<string, IEnsembleStep[] | null>();   // "name/version": null if no ensemble
}
