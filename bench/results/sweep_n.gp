# Renders sweep_n_time.png and sweep_n_memory.png: run `gnuplot sweep_n.gp` in this folder.
set datafile separator ','
set key top left noenhanced
set grid
set logscale x 2
set terminal pngcairo size 900,600 noenhanced
set xlabel 'tokens N'
cases = 'fused_forward fused_split fused_train_step materialized'
set output 'sweep_n_time.png'
set ylabel 'time per call (ms)'
set title 'fused vs materialized: time per call (H=1024 V=32768, 2 threads, BLIS skx)'
plot for [c in cases] 'sweep_n.csv' using (stringcolumn(5) eq c ? $1 : NaN):7 with linespoints title c
set output 'sweep_n_memory.png'
set ylabel 'peak RSS growth (MiB)'
set title 'fused vs materialized: peak memory (H=1024 V=32768, 2 threads)'
plot for [c in cases] 'sweep_n.csv' using (stringcolumn(5) eq c ? $1 : NaN):($12/1048576) with linespoints title c
