// The main-area model view draws with the notebook dashboard widget's own ESM
// (jupyter_triton/widgets/dashboard.js, what anywidget loads): one renderer, bundled from its
// place in the Python package rather than copied, so the two cannot drift apart.
const path = require('path');

module.exports = {
  resolve: {
    alias: {
      'jupyter-triton-dashboard$': path.resolve(__dirname, '../jupyter_triton/widgets/dashboard.js')
    }
  }
};
