/**
 * jupyter-triton: a "Triton" panel in JupyterLab's left sidebar: the served models and what
 * to do with them; a model's view opens in the main area.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';

import { ModelView } from './dashboard';
import { TritonPanel } from './panel';

const tritonIcon = new LabIcon({
  name: 'jupyter-triton:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
    '<path class="jp-icon3" fill="#616161" d="M12 2 22 20H2Zm0 5.2L6.4 17h11.2Z"/>' +
    '<circle class="jp-icon3" fill="#616161" cx="12" cy="13.6" r="2"/></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-triton:plugin',
  description: 'The Triton models the jupyter_triton server extension serves: list, load, unload, versions, config, views.',
  autoStart: true,
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, restorer: ILayoutRestorer | null) => {
    const settings = ServerConnection.makeSettings();
    // the open dashboards, one per model, saved with the workspace and restored with it
    const views = new WidgetTracker<MainAreaWidget<ModelView>>({ namespace: 'jupyter-triton-dashboard' });
    const openDashboard = (name: string): void => {
      let view = views.find(w => w.content.model === name);
      if (!view) {
        view = new MainAreaWidget({ content: new ModelView(settings, name) });
        view.id = `jupyter-triton-view-${name}`;
        view.title.label = `Triton: ${name}`;
        view.title.icon = tritonIcon;
        void views.add(view);
        app.shell.add(view, 'main');
      }
      app.shell.activateById(view.id);
    };
    app.commands.addCommand('jupyter-triton:open-dashboard', {
      label: args => (args.model ? `Triton Dashboard: ${args.model}` : 'Triton Dashboard'),
      execute: args => openDashboard(String(args.model ?? ''))
    });
    const panel = new TritonPanel(settings, { openDashboard });
    panel.title.icon = tritonIcon;
    app.shell.add(panel, 'left', { rank: 900 });
    if (restorer) {
      restorer.add(panel, panel.id);
      void restorer.restore(views, {
        command: 'jupyter-triton:open-dashboard',
        args: view => ({ model: view.content.model }),
        name: view => view.content.model
      });
    }
    app.commands.addCommand('jupyter-triton:open', {
      label: 'Show Triton Models',
      execute: () => app.shell.activateById(panel.id)
    });
  }
};

export default plugin;
