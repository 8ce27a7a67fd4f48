-- OURS: an order-entry workload on the vendored Northwind schema
INSERT INTO orders (order_id, customer_id, employee_id, order_date, required_date, ship_via, freight, ship_name, ship_city, ship_country) VALUES (20000, 'ALFKI', 1, '2026-11-25', '2026-12-09', 1, 12.5, 'Alfreds Futterkiste', 'Berlin', 'Germany');
INSERT INTO order_details (order_id, product_id, unit_price, quantity, discount) VALUES (20000, 1, 18, 5, 0), (20000, 2, 19, 1, 0.05);

UPDATE products SET units_in_stock = units_in_stock - 5, units_on_order = units_on_order + 5 WHERE product_id IN (1, 2);

UPDATE employees SET notes = notes || repeat(' Promoted.', 200) WHERE employee_id = 3;

DELETE FROM order_details WHERE order_id IN (SELECT order_id FROM orders WHERE ship_country = 'Finland');

UPDATE customers SET contact_title = 'Owner' WHERE country = 'Mexico';

INSERT INTO us_states (state_id, state_name, state_abbr, state_region) VALUES (52, 'Corpus', 'CX', 'test');
