# Renders sweep_vocab_time.png and sweep_vocab_memory.png: run `gnuplot sweep_vocab.gp` in this folder.
set datafile separator ','
set key top left noenhanced
set grid
set logscale x 2
set terminal pngcairo size 900,600 noenhanced
set xlabel 'vocabulary V'
cases = 'fused_forward fused_split fused_train_step materialized'
set output 'sweep_vocab_time.png'
set ylabel 'time per call (ms)'
set title 'fused vs materialized: time per call (N=1024 H=1024, 2 threads, BLIS skx)'
plot for [c in cases] 'sweep_vocab.csv' using (stringcolumn(5) eq c ? $3 : NaN):7 with linespoints title c
set output 'sweep_vocab_memory.png'
set ylabel 'peak RSS growth (MiB)'
set title 'fused vs materialized: peak memory (N=1024 H=1024, 2 threads)'
plot for [c in cases] 'sweep_vocab.csv' using (stringcolumn(5) eq c ? $3 : NaN):($12/1048576) with linespoints title c
