/**
 * jupyter-triton: a "Triton" panel in JupyterLab's left sidebar listing the served models.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { LabIcon } from '@jupyterlab/ui-components';

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
  description: 'Lists the Triton models the jupyter_triton server extension serves.',
  autoStart: true,
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, restorer: ILayoutRestorer | null) => {
    const panel = new TritonPanel();
    panel.title.icon = tritonIcon;
    app.shell.add(panel, 'left', { rank: 900 });
    if (restorer) {
      restorer.add(panel, panel.id);
    }
    app.commands.addCommand('jupyter-triton:open', {
      label: 'Show Triton Models',
      execute: () => app.shell.activateById(panel.id)
    });
  }
};

export default plugin;
