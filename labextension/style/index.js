import './index.css';
// the notebook dashboard widget's styles: the model view draws with its renderer
import '../../jupyter_triton/widgets/dashboard.css';
