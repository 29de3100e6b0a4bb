set datafile separator ','
set terminal pngcairo size 1000,450 noenhanced
set output 'filter_sweep.png'
set multiplot layout 1,2 title 'gradient filtering: exact vs filtered train step, one fh_bench run per point'
set logscale x 2
set format x '2^%L'
set xlabel 'eps'
set key top left
set grid
set ylabel 'backward GEMM work skipped'
plot for [d in 'f32 bf16'] for [r in '0 64'] 'filter_sweep.csv' using (strcol(1) eq d && strcol(2) eq r ? $3 : NaN):7 \
     with linespoints title sprintf('%s, rows %s', d, r eq '0' ? 'default' : r)
set ylabel 'speed-up of the train step (exact ms / filtered ms)'
plot for [d in 'f32 bf16'] for [r in '0 64'] 'filter_sweep.csv' using (strcol(1) eq d && strcol(2) eq r ? $3 : NaN):6 \
     with linespoints title sprintf('%s, rows %s', d, r eq '0' ? 'default' : r)
unset multiplot
