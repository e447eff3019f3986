/**
 * What the sidebar and the main-area model view both show of a model version, and the one
 * way both reach the server: ServerConnection (Jupyter's token/cookie and XSRF) to the
 * extension's v2 routes. One renderer, so the two views can never disagree.
 */
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

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

/** Triton's MemoryUsage entry of the statistics. */
export interface IMemoryUsage {
  type: string;
  id: number;
  byte_size: number;
}

/** The part of one GET v2/models/stats entry the views show. */
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
  batch_stats?: { batch_size: number; compute_infer: IDuration }[];
  memory_usage?: IMemoryUsage[];
  /** an ensemble's steps as they ran (an extra field, once the ensemble has run) */
  ensemble_steps?: { step: number; model: string; version: string; success: IDuration; fail: IDuration }[];
}

/** One step of an ensemble's config (ensemble_scheduling.step). */
export interface IEnsembleStep {
  model_name: string;
  model_version?: number | string;
}

/**
 * An ensemble's steps: each one's composing model and version as its config names them
 * (-1: the latest), and once it has run, the version it ran on and its runs and failures.
 */
export function renderSteps(steps: IEnsembleStep[], stats: IModelStats | undefined): HTMLElement {
  const ran = new Map((stats?.ensemble_steps || []).map(s => [s.step, s]));
  const list = document.createElement('ol');
  list.className = 'jp-TritonPanel-steps';
  list.title = "the ensemble's steps: composing model and version";
  steps.forEach((step, i) => {
    const pinned = Number(step.model_version ?? -1);
    const run = ran.get(i + 1);
    const version = run ? String(run.version) : pinned >= 0 ? String(pinned) : '';
    const li = document.createElement('li');
    li.className = 'jp-TritonPanel-step';
    li.dataset.step = String(i + 1);
    // not data-model/data-version: those name the cards
    li.dataset.composingModel = step.model_name;
    li.dataset.composingVersion = version;
    field(li, 'step-model', step.model_name);
    field(li, 'step-version', version ? `v${version}` : 'latest');
    if (run) {
      field(li, 'step-runs', `${run.success.count} runs, ${run.fail.count} failed`);
    }
    list.appendChild(li);
  });
  return list;
}

/** A v2 call through ServerConnection; a Triton error body becomes the Error's message. */
export async function requestJSON<T>(
  settings: ServerConnection.ISettings,
  path: string,
  init: RequestInit
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  if (!response.ok) {
    let message: string;
    try {
      message = JSON.parse(text).error || text;
    } catch {
      // not JSON: Jupyter's own 404 page when the route does not exist, or a proxy's page
      message =
        response.status === 404
          ? 'the jupyter_triton server extension is not running on this Jupyter server'
          : response.statusText;
    }
    throw new Error(`${path}: ${response.status} ${message}`.slice(0, 300));
  }
  return (text ? JSON.parse(text) : {}) as T;
}

export function modelPath(name: string): string {
  return `v2/models/${encodeURIComponent(name)}`;
}

/** Mean of a Triton duration per request, '–' before the first request. */
export function perRequestMs(ns: number, count: number): string {
  if (!count) {
    return '–';
  }
  const ms = ns / count / 1e6;
  return `${ms >= 100 ? ms.toFixed(0) : ms >= 1 ? ms.toFixed(2) : ms.toFixed(3)} ms`;
}

export function formatBytes(bytes: number): string {
  if (bytes >= 1 << 30) {
    return `${(bytes / (1 << 30)).toFixed(2)} GiB`;
  }
  if (bytes >= 1 << 20) {
    return `${(bytes / (1 << 20)).toFixed(1)} MiB`;
  }
  return `${(bytes / 1024).toFixed(0)} KiB`;
}

/** Memory by kind ("CPU 243.8 MiB, GPU0 1.2 GiB"), '–' when the statistics hold none. */
export function memoryText(usage: IMemoryUsage[] | undefined): string {
  if (!usage || !usage.length) {
    return '–';
  }
  return usage
    .map(u => `${u.type}${u.type === 'GPU' ? u.id : ''} ${formatBytes(u.byte_size)}`)
    .join(', ');
}

/** A span with class jp-TritonPanel-<cls>, appended to parent. */
export function field(parent: HTMLElement, cls: string, text: string): HTMLElement {
  const span = document.createElement('span');
  span.className = `jp-TritonPanel-${cls}`;
  span.textContent = text;
  parent.appendChild(span);
  return span;
}

/** The figures of one version's statistics, as classed tiles (tests read them by class). */
export function renderFigures(stats: IModelStats, perSecond: number | null = null): HTMLElement {
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
  figure('inf/s', 'rate', perSecond === null ? '–' : perSecond.toFixed(1),
         'inferences per second since the previous reading (the notebook dashboard\'s figures())');
  figure('executions', 'executions', String(stats.execution_count), 'execution count (batches run)');
  figure('queue', 'queue', perRequestMs(s.queue.ns, s.queue.count), 'average queue time per request');
  figure(
    'compute',
    'compute',
    perRequestMs(computeNs, s.compute_infer.count),
    'average compute time (input + infer + output) per request'
  );
  figure('memory', 'memory', memoryText(stats.memory_usage),
         "what the version holds (Triton's memory_usage statistics)");
  return figures;
}

/** Executions per batch size (Triton's batch_stats) as a small table. */
export function renderBatches(stats: IModelStats): HTMLElement {
  const table = document.createElement('table');
  table.className = 'jp-TritonPanel-batches';
  const head = table.insertRow();
  head.insertCell().textContent = 'batch size';
  head.insertCell().textContent = 'executions';
  for (const b of stats.batch_stats || []) {
    const row = table.insertRow();
    row.dataset.batch = String(b.batch_size);
    row.insertCell().textContent = String(b.batch_size);
    row.insertCell().textContent = String(b.compute_infer.count);
  }
  return table;
}

/** The tritonclient code that calls a model at this server (token from the environment). */
/**
 * Where the snippet's credential comes from: in a JupyterHub (the page config says so), the
 * token this server's kernels and terminals carry, or one from the hub's token page;
 * elsewhere the server's Jupyter token.
 */
function tokenLines(): string[] {
  const hubPrefix = PageConfig.getOption('hubPrefix');
  if (PageConfig.getOption('hubUser') && hubPrefix) {
    const page = `${PageConfig.getOption('hubHost')}${URLExt.join(hubPrefix, 'token')}`;
    return [
      `# JUPYTERHUB_API_TOKEN: set in this server's kernels and terminals; elsewhere, a token from ${page}`,
      'headers = {"Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"]}'
    ];
  }
  return [
    "# JUPYTER_TOKEN: this server's Jupyter token (its kernels and terminals have JUPYTER_TRITON_TOKEN, which works too)",
    'headers = {"Authorization": "token " + os.environ["JUPYTER_TOKEN"]}'
  ];
}

export function tritonclientSnippet(settings: ServerConnection.ISettings, name: string): string {
  const base = new URL(settings.baseUrl, window.location.href);
  const url = `${base.host}${base.pathname.replace(/\/$/, '')}`;
  return [
    'import os',
    'import tritonclient.http as httpclient',
    '',
    // a page served over https (JupyterHub, a proxy) wants tritonclient's TLS too
    `client = httpclient.InferenceServerClient("${url}"${base.protocol === 'https:' ? ', ssl=True' : ''})`,
    ...tokenLines(),
    `print(client.get_model_metadata("${name}", headers=headers))`,
    `# client.infer("${name}", inputs, headers=headers)`
  ].join('\n');
}
