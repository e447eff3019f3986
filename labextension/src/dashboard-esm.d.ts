/**
 * Types of the notebook dashboard widget's ESM (jupyter_triton/widgets/dashboard.js), aliased
 * to this name in webpack.config.js.
 */
declare module 'jupyter-triton-dashboard' {
  /** The part of an anywidget model the renderer uses. */
  export interface IWidgetModel {
    get(name: string): any;
    set(name: string, value: unknown): void;
    save_changes(): void;
    on(event: string, callback: () => void): void;
    off(event: string, callback: () => void): void;
  }

  export interface IRenderProps {
    model: IWidgetModel;
    el: HTMLElement;
    /** Fetch a path under the server's base URL (here: through ServerConnection). */
    request?: (path: string) => Promise<Response>;
  }

  /** Rates between two statistics snapshots ({t: seconds, model_stats}), as figures.py. */
  export interface IFigures {
    key: string;
    name: string;
    version: string;
    infPerS: number;
    reqPerS: number;
    queueUs: number | null;
    computeUs: number | null;
    failures: number;
    inferences: number;
    executions: number;
    /** p50/p95/p99 (ms), count and what they are over in words (since load, the last minute,
     * or the last requests before it) per kind; null without histograms */
    latency: Record<string, {
      p50: number | null; p95: number | null; p99: number | null; count: number; window: string;
    }> | null;
    /** seconds from the last request's end to the reading; null before the first */
    lastRequestS: number | null;
  }

  /** Percentile windows kept across readings (pass the same one to every figures() call). */
  export interface ILatencyWindows {
    seconds: number;
  }
  export function latencyWindows(seconds?: number): ILatencyWindows;

  export function figures(
    prev: { t: number; model_stats: unknown[] } | null,
    cur: { t: number; model_stats: unknown[] },
    windows?: ILatencyWindows
  ): IFigures[];

  const dashboard: { render(props: IRenderProps): () => void };
  export default dashboard;
}
